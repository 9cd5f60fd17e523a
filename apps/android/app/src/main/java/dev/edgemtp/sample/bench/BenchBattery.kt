package dev.edgemtp.sample.bench

import dev.edgemtp.sample.battery.BatterySnapshot
import dev.edgemtp.sample.engine.BatteryReading

/**
 * The counter a benchmark run records (its "battery": source, unit, start, end): the charge
 * counter where reported, else the energy counter, else the percentage.
 */
fun BatterySnapshot.toBenchReading(): BatteryReading? = when {
    chargeMicroAmpHours != null ->
        BatteryReading("BatteryManager.BATTERY_PROPERTY_CHARGE_COUNTER", chargeMicroAmpHours.toDouble(), "uAh")
    energyNanoWattHours != null ->
        BatteryReading("BatteryManager.BATTERY_PROPERTY_ENERGY_COUNTER", energyNanoWattHours.toDouble(), "nWh")
    percent != null -> BatteryReading("BatteryManager.BATTERY_PROPERTY_CAPACITY", percent.toDouble(), "percent")
    else -> null
}
