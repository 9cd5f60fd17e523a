import SwiftUI

struct GenerationSettingsSection: View {
    @Binding var settings: GenerationSettings
    let depths: [DraftDepth]

    var body: some View {
        Section {
            Picker("Draft depth", selection: $settings.depth) {
                ForEach(depths, id: \.self) { depth in
                    Text(depth.label).tag(depth)
                }
            }
            .pickerStyle(.segmented)
            Toggle("Chat turn", isOn: $settings.chat)
            Stepper("Max tokens: \(settings.maxNewTokens)", value: $settings.maxNewTokens, in: 1...4096, step: 16)
            LabeledContent("Temperature \(settings.temperature, format: .number.precision(.fractionLength(2)))") {
                Slider(value: $settings.temperature, in: 0...2, step: 0.05)
            }
            if settings.temperature > 0 {
                LabeledContent("Top-p \(settings.topP, format: .number.precision(.fractionLength(2)))") {
                    Slider(value: $settings.topP, in: 0.05...1, step: 0.05)
                }
            }
        } header: {
            Text("Decoding")
        } footer: {
            Text("""
                AR decodes one token per target forward; 1–3 pin the drafter's depth; Adaptive picks \
                each round's depth from measured costs and acceptance. Temperature 0 is greedy, and \
                then every depth commits the same tokens as AR.
                """)
        }
    }
}
