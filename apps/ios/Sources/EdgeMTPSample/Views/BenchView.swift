import SwiftUI

/// `edgemtp bench` on the phone: the core runs the plan and writes the result JSON into
/// Documents/bench, for `edgemtp bench collect --from`.
struct BenchView: View {
    @Environment(SampleModel.self) private var model

    var body: some View {
        @Bindable var model = model
        Form {
            Section {
                TextField("Prompt lengths (pp)", text: $model.benchSettings.promptLengths)
                    .plainEntry(numbers: true)
                TextField("Generated tokens (tg)", text: $model.benchSettings.generatedTokens)
                    .plainEntry(numbers: true)
                TextField("Draft depths (0 is AR)", text: $model.benchSettings.depths)
                    .plainEntry(numbers: true)
                Stepper("Timed runs per test: \(model.benchSettings.repetitions)",
                        value: $model.benchSettings.repetitions, in: 1...20)
                TextField("Device profile (optional, e.g. iphone-17-pro)", text: $model.benchSettings.profile)
                    .plainEntry(numbers: false)
            } header: {
                Text("Plan")
            } footer: {
                Text("Numbers separated by commas. Each test gets a warm-up; AR and every depth run on the same prompts, and greedy drafts are checked against AR's tokens.")
            }
            .disabled(model.isBenchmarking)

            Section {
                if model.isBenchmarking {
                    if let progress = model.benchProgress {
                        ProgressView(value: Double(progress.done), total: Double(max(progress.planned, 1))) {
                            Text("Run \(progress.done + 1) of \(progress.planned)")
                        } currentValueLabel: {
                            Text(progress.next)
                        }
                    } else {
                        ProgressView("Starting…")
                    }
                    Button("Stop after this run", systemImage: "stop.fill", role: .destructive) { model.stop() }
                } else {
                    Button("Run benchmark", systemImage: "speedometer") { model.runBench() }
                        .disabled(model.bundle == nil || model.isBusy)
                }
            } footer: {
                Text("Keep the app in front and the screen on: iOS slows or suspends apps in the background. A stopped benchmark keeps the runs so far.")
            }

            Section {
                ForEach(model.benchResults, id: \.self) { file in
                    ShareLink(item: file) {
                        Label(file.lastPathComponent, systemImage: "square.and.arrow.up")
                    }
                }
            } header: {
                Text("Results in Documents/bench")
            } footer: {
                Text("Copy the bench folder off the phone (Finder's Files tab, or share the files), then run `edgemtp bench collect --from bench`.")
            }
        }
        .navigationTitle("Bench")
    }
}

private extension View {
    /// Settings typed as written: no autocorrection or capitals; digits and commas for lists.
    func plainEntry(numbers: Bool) -> some View {
        #if os(iOS)
        return keyboardType(numbers ? .numbersAndPunctuation : .asciiCapable)
            .textInputAutocapitalization(.never)
            .autocorrectionDisabled()
        #else
        return autocorrectionDisabled()
        #endif
    }
}
