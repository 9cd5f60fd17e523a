package dev.edgemtp.sample.ui

import androidx.compose.foundation.layout.Arrangement
import androidx.compose.foundation.layout.Column
import androidx.compose.foundation.layout.Row
import androidx.compose.foundation.layout.padding
import androidx.compose.material3.MaterialTheme
import androidx.compose.material3.Text
import androidx.compose.material3.TextButton
import androidx.compose.runtime.Composable
import androidx.compose.ui.Alignment
import androidx.compose.ui.Modifier
import androidx.compose.ui.unit.dp

/** Which bundle is open, on how many threads, and how to push one when there is none. */
@Composable
fun BundleBar(
    state: SampleUiState,
    onOpen: (String) -> Unit,
    onRefresh: () -> Unit,
    onThreads: (Int) -> Unit,
    modifier: Modifier = Modifier,
) {
    val selected = when (val status = state.bundle) {
        is BundleStatus.Opening -> status.name
        is BundleStatus.Ready -> status.bundle.name
        is BundleStatus.Failed -> status.name
        BundleStatus.NoneSelected -> null
    }
    val enabled = !state.busy && state.bundle !is BundleStatus.Opening
    Column(modifier.padding(horizontal = 16.dp, vertical = 8.dp), verticalArrangement = Arrangement.spacedBy(4.dp)) {
        Row(verticalAlignment = Alignment.CenterVertically, horizontalArrangement = Arrangement.spacedBy(8.dp)) {
            ChoiceMenu("Bundle", state.bundleNames, selected, onOpen, enabled = enabled)
            ChoiceMenu(
                label = "Threads",
                options = (1..Runtime.getRuntime().availableProcessors()).toList(),
                selected = state.threads,
                onSelect = onThreads,
                enabled = enabled,
            )
            TextButton(onClick = onRefresh, enabled = enabled) { Text("Refresh") }
        }
        Text(statusLine(state), style = MaterialTheme.typography.bodySmall)
    }
}

private fun statusLine(state: SampleUiState): String = when (val status = state.bundle) {
    is BundleStatus.Ready -> with(status.bundle) {
        "$backend/$delegate · max context $maxContext · " +
            if (hasDrafter) "MTP up to depth $maxDraft" else "no drafter: autoregressive only"
    }
    is BundleStatus.Opening -> "Opening ${status.name}…"
    is BundleStatus.Failed -> "${status.name}: ${status.message}"
    BundleStatus.NoneSelected -> when {
        state.bundlesDir == null -> "Shared storage is not available."
        state.bundleNames.isEmpty() ->
            "No bundle yet. Push one with: adb push BUNDLE ${state.bundlesDir}/NAME, then Refresh."
        else -> "Choose a bundle."
    }
}
