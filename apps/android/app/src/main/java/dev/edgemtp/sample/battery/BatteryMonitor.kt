package dev.edgemtp.sample.battery

import android.content.Context
import android.content.Intent
import android.content.IntentFilter
import android.os.BatteryManager
import android.os.SystemClock
import androidx.core.content.ContextCompat

/** The battery as BatteryManager reports it at one moment; a null field is one this device does not report. */
data class BatterySnapshot(
    val elapsedNanos: Long,
    /** BATTERY_PROPERTY_CHARGE_COUNTER, µAh. */
    val chargeMicroAmpHours: Long?,
    /** BATTERY_PROPERTY_ENERGY_COUNTER, nWh (few devices report it). */
    val energyNanoWattHours: Long?,
    /** BATTERY_PROPERTY_CURRENT_NOW, µA; negative while discharging on most devices. */
    val currentMicroAmps: Long?,
    /** BATTERY_PROPERTY_CAPACITY, percent. */
    val percent: Int?,
    /** From the sticky ACTION_BATTERY_CHANGED intent. */
    val temperatureCelsius: Double?,
    val voltageMillivolts: Int?,
    val plugged: Boolean,
)

class BatteryMonitor(context: Context) {
    private val appContext = context.applicationContext
    private val manager = appContext.getSystemService(BatteryManager::class.java)

    fun snapshot(): BatterySnapshot {
        // A null receiver reads the last sticky broadcast without registering anything.
        val status = ContextCompat.registerReceiver(
            appContext, null, IntentFilter(Intent.ACTION_BATTERY_CHANGED), ContextCompat.RECEIVER_NOT_EXPORTED,
        )
        val temperature = status?.getIntExtra(BatteryManager.EXTRA_TEMPERATURE, Int.MIN_VALUE)
        val voltage = status?.getIntExtra(BatteryManager.EXTRA_VOLTAGE, -1)
        return BatterySnapshot(
            elapsedNanos = SystemClock.elapsedRealtimeNanos(),
            chargeMicroAmpHours = intProperty(BatteryManager.BATTERY_PROPERTY_CHARGE_COUNTER)
                ?.takeIf { it > 0 }?.toLong(),
            energyNanoWattHours = longProperty(BatteryManager.BATTERY_PROPERTY_ENERGY_COUNTER)
                ?.takeIf { it > 0 },
            currentMicroAmps = intProperty(BatteryManager.BATTERY_PROPERTY_CURRENT_NOW)?.toLong(),
            percent = intProperty(BatteryManager.BATTERY_PROPERTY_CAPACITY),
            temperatureCelsius = temperature?.takeIf { it != Int.MIN_VALUE }?.let { it / 10.0 },
            voltageMillivolts = voltage?.takeIf { it > 0 },
            plugged = (status?.getIntExtra(BatteryManager.EXTRA_PLUGGED, 0) ?: 0) != 0,
        )
    }

    /** CURRENT_NOW alone: what [measureBattery] samples during a generation. */
    fun currentMicroAmps(): Long? = intProperty(BatteryManager.BATTERY_PROPERTY_CURRENT_NOW)?.toLong()

    // Unsupported properties read Integer.MIN_VALUE (Long.MIN_VALUE), or 0 on older releases.
    private fun intProperty(id: Int): Int? = manager?.getIntProperty(id)?.takeIf { it != Int.MIN_VALUE }

    private fun longProperty(id: Int): Long? = manager?.getLongProperty(id)?.takeIf { it != Long.MIN_VALUE }
}
