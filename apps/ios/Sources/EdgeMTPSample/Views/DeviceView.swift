import SwiftUI

struct DeviceView: View {
    @Environment(SampleModel.self) private var model

    var body: some View {
        Form {
            Section {
                DeviceConditionsRows(conditions: model.conditions.current)
            } footer: {
                Text("""
                    iOS gives apps no energy figures: no battery charge, current or power, only this \
                    coarse level and these states. Each bench run records the level before and after \
                    it, with the charging state, thermal state and Low Power Mode, in the result's \
                    "battery" object. For energy, use Xcode's Energy gauge or Instruments.
                    """)
            }
        }
        .navigationTitle("Device")
    }
}

struct DeviceConditionsRows: View {
    let conditions: DeviceConditions

    var body: some View {
        LabeledContent("Battery", value: battery)
        LabeledContent("Thermal state", value: conditions.thermalState.rawValue)
        LabeledContent("Low Power Mode", value: conditions.isLowPowerModeEnabled ? "on" : "off")
    }

    private var battery: String {
        guard let level = conditions.batteryLevel else { return "unknown (\(conditions.batteryState.rawValue))" }
        return "\(level.formatted(.percent.precision(.fractionLength(0)))), \(conditions.batteryState.rawValue)"
    }
}
