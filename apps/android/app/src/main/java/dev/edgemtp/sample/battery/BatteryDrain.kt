package dev.edgemtp.sample.battery

import kotlinx.coroutines.Dispatchers
import kotlinx.coroutines.coroutineScope
import kotlinx.coroutines.delay
import kotlinx.coroutines.isActive
import kotlinx.coroutines.launch

/** The battery over one generation: the counters' change and CURRENT_NOW sampled meanwhile. */
data class BatteryDrain(
    val seconds: Double,
    /** Charge drawn (before - after), µAh; counters step coarsely (often 1 mAh) on many phones. */
    val chargeMicroAmpHours: Long?,
    /** Energy drawn, nWh, where ENERGY_COUNTER is reported. */
    val energyNanoWattHours: Long?,
    /** Mean of the CURRENT_NOW samples, µA, in the device's sign convention. */
    val meanCurrentMicroAmps: Double?,
    val samples: Int,
    val temperatureStartCelsius: Double?,
    val temperatureEndCelsius: Double?,
    /** A charger was attached at either end: the counters then say little about the drain. */
    val plugged: Boolean,
) {
    companion object {
        fun between(before: BatterySnapshot, after: BatterySnapshot, currents: List<Long>) = BatteryDrain(
            seconds = (after.elapsedNanos - before.elapsedNanos) / 1e9,
            chargeMicroAmpHours = difference(before.chargeMicroAmpHours, after.chargeMicroAmpHours),
            energyNanoWattHours = difference(before.energyNanoWattHours, after.energyNanoWattHours),
            meanCurrentMicroAmps = currents.takeIf { it.isNotEmpty() }?.average(),
            samples = currents.size,
            temperatureStartCelsius = before.temperatureCelsius,
            temperatureEndCelsius = after.temperatureCelsius,
            plugged = before.plugged || after.plugged,
        )

        private fun difference(before: Long?, after: Long?): Long? =
            if (before != null && after != null) before - after else null
    }
}

/** Runs [block] while sampling CURRENT_NOW every [sampleMillis]; returns its result and the drain. */
suspend fun <T> BatteryMonitor.measureBattery(sampleMillis: Long = 250, block: suspend () -> T): Pair<T, BatteryDrain> =
    coroutineScope {
        val currents = mutableListOf<Long>()
        val before = snapshot()
        val sampler = launch(Dispatchers.Default) {
            while (isActive) {
                currentMicroAmps()?.let { synchronized(currents) { currents += it } }
                delay(sampleMillis)
            }
        }
        try {
            val result = block()
            val after = snapshot()
            result to BatteryDrain.between(before, after, synchronized(currents) { currents.toList() })
        } finally {
            sampler.cancel()
        }
    }
