import EdgeMTPCoreML

/// Reads what iOS says about power for each bench run's "battery" object.
///
/// The core takes a reading before and after each run and records it on every run that completed
/// with both: source, unit and the levels, and each extra as "<key>_start" / "<key>_end". iOS has
/// no energy reading, so the level is UIDevice.batteryLevel in percent; the charging state,
/// thermal state and Low Power Mode go with it as extras. No level (Simulator, Mac): no reading.
final class BenchConditionsRecorder: Sendable {
    private let conditions: LatestDeviceConditions

    init(conditions: LatestDeviceConditions) {
        self.conditions = conditions
    }

    /// The reading now; the core calls it before and after each run, on the engine's queue.
    func reading() -> EMBatteryReading? {
        let now = conditions.snapshot()
        guard let level = now.batteryLevel else { return nil }
        return EMBatteryReading(
            source: "UIDevice.batteryLevel", start: level * 100, end: level * 100, unit: "percent",
            extra: [
                "battery_state": now.batteryState.rawValue,
                "thermal_state": now.thermalState.rawValue,
                "low_power_mode": String(now.isLowPowerModeEnabled),
            ])
    }
}
