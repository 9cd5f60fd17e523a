package dev.edgemtp.sample

import android.os.Bundle
import androidx.activity.ComponentActivity
import androidx.activity.compose.setContent
import androidx.activity.enableEdgeToEdge
import dev.edgemtp.sample.ui.SampleApp
import dev.edgemtp.sample.ui.theme.EdgemtpTheme

class MainActivity : ComponentActivity() {
    override fun onCreate(savedInstanceState: Bundle?) {
        super.onCreate(savedInstanceState)
        enableEdgeToEdge()
        setContent {
            EdgemtpTheme {
                SampleApp()
            }
        }
    }
}
