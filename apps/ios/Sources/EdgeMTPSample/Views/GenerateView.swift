import SwiftUI

struct GenerateView: View {
    @Environment(SampleModel.self) private var model

    var body: some View {
        @Bindable var model = model
        Form {
            Section("Prompt") {
                TextField("Prompt", text: $model.prompt, axis: .vertical)
                    .lineLimit(3...8)
            }
            GenerationSettingsSection(settings: $model.settings, depths: DraftDepth.choices(for: model.bundle))
            Section {
                if model.isGenerating {
                    Button("Stop", systemImage: "stop.fill", role: .destructive) { model.stop() }
                } else {
                    Button("Generate", systemImage: "play.fill") { model.generate() }
                        .disabled(model.bundle?.hasTokenizer != true || model.isBusy)
                }
            }
            Section("Output") {
                Text(model.output.isEmpty ? " " : model.output)
                    .textSelection(.enabled)
                    .frame(maxWidth: .infinity, alignment: .leading)
            }
            if let result = model.result {
                GenerationStatsSection(result: result)
            }
            Section("Device") {
                DeviceConditionsRows(conditions: model.conditions.current)
            }
        }
        .navigationTitle(model.bundle?.name ?? "Generate")
        .toolbar {
            Button("Forget the cache", systemImage: "arrow.counterclockwise") { model.resetCache() }
                .disabled(model.bundle == nil || model.isBusy)
        }
    }
}
