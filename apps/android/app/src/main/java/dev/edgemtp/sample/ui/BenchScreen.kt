package dev.edgemtp.sample.ui

import androidx.compose.foundation.layout.Arrangement
import androidx.compose.foundation.layout.Column
import androidx.compose.foundation.layout.Row
import androidx.compose.foundation.layout.fillMaxSize
import androidx.compose.foundation.layout.fillMaxWidth
import androidx.compose.foundation.layout.padding
import androidx.compose.foundation.rememberScrollState
import androidx.compose.foundation.text.KeyboardOptions
import androidx.compose.foundation.verticalScroll
import androidx.compose.material3.Button
import androidx.compose.material3.LinearProgressIndicator
import androidx.compose.material3.MaterialTheme
import androidx.compose.material3.OutlinedButton
import androidx.compose.material3.OutlinedTextField
import androidx.compose.material3.Text
import androidx.compose.runtime.Composable
import androidx.compose.ui.Modifier
import androidx.compose.ui.text.input.KeyboardType
import androidx.compose.ui.unit.dp
import dev.edgemtp.sample.bench.BenchForm

@Composable
fun BenchScreen(
    state: SampleUiState,
    onForm: ((BenchForm) -> BenchForm) -> Unit,
    onRun: () -> Unit,
    onStop: () -> Unit,
) {
    val bench = state.bench
    val form = bench.form
    val editable = !state.busy
    Column(
        Modifier.fillMaxSize().verticalScroll(rememberScrollState()).padding(16.dp),
        verticalArrangement = Arrangement.spacedBy(12.dp),
    ) {
        Text(
            "Runs `edgemtp bench`'s plan on this phone (greedy; a warm-up per test; AR and each " +
                "depth on the same prompts) and writes the result for `edgemtp bench collect --adb`.",
            style = MaterialTheme.typography.bodySmall,
        )
        PlanField("Prompt lengths (pp)", form.pp, editable) { v -> onForm { it.copy(pp = v) } }
        PlanField("Generated tokens (tg)", form.tg, editable) { v -> onForm { it.copy(tg = v) } }
        PlanField("Draft depths (0 = AR)", form.depths, editable) { v -> onForm { it.copy(depths = v) } }
        PlanField("Rounds per test", form.repeat, editable) { v -> onForm { it.copy(repeat = v) } }
        OutlinedTextField(
            value = form.profile,
            onValueChange = { v -> onForm { it.copy(profile = v) } },
            label = { Text("Device profile (optional, e.g. pixel-10-pro)") },
            singleLine = true,
            enabled = editable,
            modifier = Modifier.fillMaxWidth(),
        )
        Row(horizontalArrangement = Arrangement.spacedBy(8.dp)) {
            if (bench.running) {
                OutlinedButton(onClick = onStop) { Text("Stop") }
            } else {
                Button(onClick = onRun, enabled = state.openBundle != null && editable) { Text("Run benchmark") }
            }
        }
        bench.progress?.let { progress ->
            LinearProgressIndicator(
                progress = { if (progress.planned > 0) progress.done.toFloat() / progress.planned else 0f },
                modifier = Modifier.fillMaxWidth(),
            )
            Text(
                "${progress.done} / ${progress.planned} runs · next: ${progress.next}",
                style = MaterialTheme.typography.bodySmall,
            )
        }
        bench.error?.let { Text(it, color = MaterialTheme.colorScheme.error) }
        bench.resultPath?.let {
            Text("Wrote $it\nOn the host: edgemtp bench collect --adb", style = MaterialTheme.typography.bodyMedium)
        }
    }
}

@Composable
private fun PlanField(label: String, value: String, enabled: Boolean, onChange: (String) -> Unit) {
    OutlinedTextField(
        value = value,
        onValueChange = onChange,
        label = { Text(label) },
        singleLine = true,
        enabled = enabled,
        keyboardOptions = KeyboardOptions(keyboardType = KeyboardType.Number),
        modifier = Modifier.fillMaxWidth(),
    )
}
