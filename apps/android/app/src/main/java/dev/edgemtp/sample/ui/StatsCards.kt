package dev.edgemtp.sample.ui

import androidx.compose.foundation.layout.Arrangement
import androidx.compose.foundation.layout.Column
import androidx.compose.foundation.layout.fillMaxWidth
import androidx.compose.foundation.layout.padding
import androidx.compose.material3.Card
import androidx.compose.material3.MaterialTheme
import androidx.compose.material3.Text
import androidx.compose.runtime.Composable
import androidx.compose.ui.Modifier
import androidx.compose.ui.unit.dp
import dev.edgemtp.sample.battery.BatteryDrain
import dev.edgemtp.sample.engine.GenerationStats

@Composable
fun GenerationStatsCard(stats: GenerationStats) {
    MeasurementCard("Speed") {
        val cached = if (stats.reusedTokens > 0) " (${stats.reusedTokens} cached)" else ""
        MetricRow("Prompt", "${stats.promptTokens} tokens$cached")
        MetricRow("Time to first token", "%.0f ms".format(stats.ttftSeconds * 1000))
        MetricRow("Prefill", "%.1f tok/s".format(stats.prefillTokensPerSecond))
        MetricRow("Decode", "%.1f tok/s (%d tokens)".format(stats.decodeTokensPerSecond, stats.tokens.size))
        if (stats.draftedPerRound.any { it > 0 }) {
            MetricRow("Acceptance", "%.0f %%".format(stats.acceptance * 100))
            MetricRow("Tokens per round", "%.2f over %d rounds".format(stats.tokensPerRound, stats.rounds))
        }
        MetricRow("Stopped by", stats.stopReason)
        stats.phaseNames.zip(stats.phaseSeconds.toList()).forEach { (phase, seconds) ->
            MetricRow("  $phase", "%.0f ms".format(seconds * 1000))
        }
    }
}

@Composable
fun BatteryCard(drain: BatteryDrain) {
    MeasurementCard("Battery over %.1f s".format(drain.seconds)) {
        if (drain.plugged) MetricRow("Charger", "attached: the counters include charging")
        MetricRow("Charge drawn", drain.chargeMicroAmpHours?.let { "%.2f mAh".format(it / 1000.0) } ?: "not reported")
        drain.energyNanoWattHours?.let { MetricRow("Energy drawn", "%.3f mWh".format(it / 1e6)) }
        val current = drain.meanCurrentMicroAmps?.let { "%.0f mA (%d samples)".format(it / 1000, drain.samples) }
        MetricRow("CURRENT_NOW mean", current ?: "not reported")
        val start = drain.temperatureStartCelsius
        val end = drain.temperatureEndCelsius
        if (start != null && end != null) MetricRow("Temperature", "%.1f → %.1f °C".format(start, end))
    }
}

@Composable
private fun MeasurementCard(title: String, content: @Composable () -> Unit) {
    Card(Modifier.fillMaxWidth()) {
        Column(Modifier.padding(12.dp), verticalArrangement = Arrangement.spacedBy(2.dp)) {
            Text(title, style = MaterialTheme.typography.titleSmall)
            content()
        }
    }
}
