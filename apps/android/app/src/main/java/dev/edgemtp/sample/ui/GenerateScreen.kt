package dev.edgemtp.sample.ui

import androidx.compose.foundation.horizontalScroll
import androidx.compose.foundation.layout.Arrangement
import androidx.compose.foundation.layout.Column
import androidx.compose.foundation.layout.Row
import androidx.compose.foundation.layout.fillMaxSize
import androidx.compose.foundation.layout.fillMaxWidth
import androidx.compose.foundation.layout.padding
import androidx.compose.foundation.rememberScrollState
import androidx.compose.foundation.text.selection.SelectionContainer
import androidx.compose.foundation.verticalScroll
import androidx.compose.material3.Button
import androidx.compose.material3.Card
import androidx.compose.material3.FilterChip
import androidx.compose.material3.MaterialTheme
import androidx.compose.material3.OutlinedButton
import androidx.compose.material3.OutlinedTextField
import androidx.compose.material3.Switch
import androidx.compose.material3.Text
import androidx.compose.material3.TextButton
import androidx.compose.runtime.Composable
import androidx.compose.ui.Alignment
import androidx.compose.ui.Modifier
import androidx.compose.ui.unit.dp

private val MAX_TOKEN_CHOICES = listOf(32, 64, 128, 256, 512, 1024)

@Composable
fun GenerateScreen(
    state: SampleUiState,
    onPrompt: (String) -> Unit,
    onSettings: ((GenerationSettings) -> GenerationSettings) -> Unit,
    onGenerate: () -> Unit,
    onStop: () -> Unit,
    onResetCache: () -> Unit,
) {
    val settings = state.settings
    val generation = state.generation
    val ready = state.openBundle != null
    val editable = !state.busy
    Column(
        Modifier.fillMaxSize().verticalScroll(rememberScrollState()).padding(16.dp),
        verticalArrangement = Arrangement.spacedBy(12.dp),
    ) {
        OutlinedTextField(
            value = state.prompt,
            onValueChange = onPrompt,
            label = { Text("Prompt") },
            minLines = 3,
            enabled = editable,
            modifier = Modifier.fillMaxWidth(),
        )
        DepthChips(
            choices = DepthChoice.available(state.openBundle),
            selected = settings.depth,
            enabled = editable,
            onSelect = { depth -> onSettings { it.copy(depth = depth) } },
        )
        LabeledSlider(
            label = "Temperature",
            value = settings.temperature,
            range = 0f..1.5f,
            steps = 14,
            onChange = { t -> onSettings { it.copy(temperature = t) } },
            valueText = if (settings.temperature == 0f) "0 (greedy)" else "%.2f".format(settings.temperature),
            enabled = editable,
        )
        LabeledSlider(
            label = "Top-p",
            value = settings.topP,
            range = 0.05f..1f,
            steps = 18,
            onChange = { p -> onSettings { it.copy(topP = p) } },
            valueText = "%.2f".format(settings.topP),
            enabled = editable && settings.temperature > 0f,
        )
        Row(verticalAlignment = Alignment.CenterVertically, horizontalArrangement = Arrangement.spacedBy(8.dp)) {
            Switch(
                checked = settings.chat,
                onCheckedChange = { chat -> onSettings { it.copy(chat = chat) } },
                enabled = editable,
            )
            Text("Chat turn")
            ChoiceMenu(
                label = "Max tokens",
                options = MAX_TOKEN_CHOICES,
                selected = settings.maxNewTokens,
                onSelect = { n -> onSettings { it.copy(maxNewTokens = n) } },
                enabled = editable,
            )
        }
        Row(horizontalArrangement = Arrangement.spacedBy(8.dp)) {
            if (generation.running) {
                OutlinedButton(onClick = onStop) { Text("Stop") }
            } else {
                Button(onClick = onGenerate, enabled = ready && editable && state.prompt.isNotBlank()) {
                    Text("Generate")
                }
            }
            TextButton(onClick = onResetCache, enabled = ready && editable) { Text("Reset cache") }
        }
        generation.error?.let { Text(it, color = MaterialTheme.colorScheme.error) }
        if (generation.output.isNotEmpty()) {
            Card(Modifier.fillMaxWidth()) {
                SelectionContainer { Text(generation.output, Modifier.padding(12.dp)) }
            }
        }
        generation.stats?.let { GenerationStatsCard(it) }
        generation.battery?.let { BatteryCard(it) }
    }
}

@Composable
private fun DepthChips(
    choices: List<DepthChoice>,
    selected: DepthChoice,
    enabled: Boolean,
    onSelect: (DepthChoice) -> Unit,
) {
    Column {
        Text("Draft depth", style = MaterialTheme.typography.labelLarge)
        Row(Modifier.horizontalScroll(rememberScrollState()), horizontalArrangement = Arrangement.spacedBy(8.dp)) {
            choices.forEach { choice ->
                FilterChip(
                    selected = choice == selected,
                    onClick = { onSelect(choice) },
                    label = { Text(choice.label) },
                    enabled = enabled,
                )
            }
        }
    }
}
