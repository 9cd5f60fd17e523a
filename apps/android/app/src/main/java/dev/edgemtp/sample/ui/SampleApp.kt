package dev.edgemtp.sample.ui

import androidx.compose.foundation.layout.Column
import androidx.compose.foundation.layout.fillMaxSize
import androidx.compose.foundation.layout.padding
import androidx.compose.material3.ExperimentalMaterial3Api
import androidx.compose.material3.PrimaryTabRow
import androidx.compose.material3.Scaffold
import androidx.compose.material3.Tab
import androidx.compose.material3.Text
import androidx.compose.material3.TopAppBar
import androidx.compose.runtime.Composable
import androidx.compose.runtime.DisposableEffect
import androidx.compose.runtime.getValue
import androidx.compose.runtime.mutableIntStateOf
import androidx.compose.runtime.saveable.rememberSaveable
import androidx.compose.runtime.setValue
import androidx.compose.ui.Modifier
import androidx.compose.ui.platform.LocalView
import androidx.lifecycle.compose.collectAsStateWithLifecycle
import androidx.lifecycle.viewmodel.compose.viewModel

@OptIn(ExperimentalMaterial3Api::class)
@Composable
fun SampleApp(viewModel: SampleViewModel = viewModel()) {
    val state by viewModel.state.collectAsStateWithLifecycle()
    var tab by rememberSaveable { mutableIntStateOf(0) }

    // A benchmark runs for minutes: a screen that sleeps would send the app to the background
    // and the phone into a slower power state mid-run.
    val view = LocalView.current
    DisposableEffect(state.busy) {
        view.keepScreenOn = state.busy
        onDispose { view.keepScreenOn = false }
    }

    Scaffold(topBar = { TopAppBar(title = { Text("edgemtp") }) }) { padding ->
        Column(Modifier.padding(padding).fillMaxSize()) {
            BundleBar(
                state = state,
                onOpen = viewModel::openBundle,
                onRefresh = viewModel::refreshBundles,
                onThreads = viewModel::setThreads,
            )
            PrimaryTabRow(selectedTabIndex = tab) {
                Tab(selected = tab == 0, onClick = { tab = 0 }, text = { Text("Generate") })
                Tab(selected = tab == 1, onClick = { tab = 1 }, text = { Text("Benchmark") })
            }
            when (tab) {
                0 -> GenerateScreen(
                    state = state,
                    onPrompt = viewModel::setPrompt,
                    onSettings = viewModel::updateSettings,
                    onGenerate = viewModel::generate,
                    onStop = viewModel::stop,
                    onResetCache = viewModel::resetCache,
                )
                else -> BenchScreen(
                    state = state,
                    onForm = viewModel::updateBenchForm,
                    onRun = viewModel::runBench,
                    onStop = viewModel::stop,
                )
            }
        }
    }
}
