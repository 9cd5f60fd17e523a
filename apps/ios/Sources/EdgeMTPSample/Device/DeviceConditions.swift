import Foundation
import Observation
import Synchronization
#if canImport(UIKit)
import UIKit
#endif

/// What iOS tells an app about power and heat. Energy is not part of it: no public API gives an
/// app the battery's charge, current or power, only this coarse level (reported in steps, 5 %
/// on many devices) and the states below.
struct DeviceConditions: Sendable, Equatable {
    enum BatteryState: String, Sendable {
        case unknown, unplugged, charging, full
    }

    enum ThermalState: String, Sendable {
        case nominal, fair, serious, critical, unknown
    }

    var batteryLevel: Double?  // 0...1; nil where the system does not say (Simulator, Mac)
    var batteryState: BatteryState
    var thermalState: ThermalState
    var isLowPowerModeEnabled: Bool

    /// Reads UIDevice, which belongs to the main actor.
    @MainActor static func read() -> DeviceConditions {
        let process = ProcessInfo.processInfo
        #if os(iOS)
        let device = UIDevice.current
        let level = device.batteryLevel  // -1 while unknown
        return DeviceConditions(
            batteryLevel: level >= 0 ? Double(level) : nil,
            batteryState: BatteryState(device.batteryState),
            thermalState: ThermalState(process.thermalState),
            isLowPowerModeEnabled: process.isLowPowerModeEnabled)
        #else
        return DeviceConditions(
            batteryLevel: nil, batteryState: .unknown,
            thermalState: ThermalState(process.thermalState),
            isLowPowerModeEnabled: process.isLowPowerModeEnabled)
        #endif
    }
}

extension DeviceConditions.ThermalState {
    init(_ state: ProcessInfo.ThermalState) {
        switch state {
        case .nominal: self = .nominal
        case .fair: self = .fair
        case .serious: self = .serious
        case .critical: self = .critical
        @unknown default: self = .unknown
        }
    }
}

#if os(iOS)
extension DeviceConditions.BatteryState {
    init(_ state: UIDevice.BatteryState) {
        switch state {
        case .unplugged: self = .unplugged
        case .charging: self = .charging
        case .full: self = .full
        case .unknown: self = .unknown
        @unknown default: self = .unknown
        }
    }
}
#endif

/// The latest conditions for code off the main actor (the bench hooks run on the engine's
/// queue, where UIDevice may not be read).
final class LatestDeviceConditions: Sendable {
    private let value: Mutex<DeviceConditions>

    init(_ initial: DeviceConditions) {
        value = Mutex(initial)
    }

    func store(_ conditions: DeviceConditions) {
        value.withLock { $0 = conditions }
    }

    func snapshot() -> DeviceConditions {
        value.withLock { $0 }
    }
}

/// Keeps `current` up to date from the system's notifications.
@MainActor @Observable
final class DeviceConditionsMonitor {
    private(set) var current: DeviceConditions
    let latest: LatestDeviceConditions
    @ObservationIgnored private var observers: [any NSObjectProtocol] = []

    init() {
        #if os(iOS)
        UIDevice.current.isBatteryMonitoringEnabled = true  // batteryLevel is -1 until then
        #endif
        let now = DeviceConditions.read()
        current = now
        latest = LatestDeviceConditions(now)
        var names: [Notification.Name] = [
            ProcessInfo.thermalStateDidChangeNotification, .NSProcessInfoPowerStateDidChange,
        ]
        #if os(iOS)
        names += [UIDevice.batteryLevelDidChangeNotification, UIDevice.batteryStateDidChangeNotification]
        #endif
        // The monitor lives as long as the app, so the observers are never removed.
        observers = names.map { name in
            NotificationCenter.default.addObserver(forName: name, object: nil, queue: .main) { [weak self] _ in
                MainActor.assumeIsolated { _ = self?.refresh() }
            }
        }
    }

    func refresh() {
        current = DeviceConditions.read()
        latest.store(current)
    }
}
