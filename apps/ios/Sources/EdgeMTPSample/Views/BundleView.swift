import SwiftUI
import UniformTypeIdentifiers

/// Choosing the bundle: one copied into the app's Documents (Finder or Files), or any folder
/// picked in Files.
struct BundleView: View {
    @Environment(SampleModel.self) private var model
    @State private var isPickingFolder = false

    var body: some View {
        List {
            Section("Open") {
                if let bundle = model.bundle {
                    BundleSummaryRows(bundle: bundle)
                } else {
                    Text("No bundle open").foregroundStyle(.secondary)
                }
            }
            Section {
                ForEach(model.library, id: \.self) { folder in
                    Button(folder.lastPathComponent) { model.open(folder) }
                        .disabled(model.isBusy)
                }
            } header: {
                Text("In Documents")
            } footer: {
                Text("""
                    Export with `edgemtp export --backend coreml --delegate npu` (or metal, cpu), then \
                    copy the bundle folder into this app's Documents with Finder (the phone's Files tab) \
                    or the Files app, or open it from anywhere with Open from Files.
                    """)
            }
        }
        .navigationTitle("Bundle")
        .toolbar {
            Button("Open from Files", systemImage: "folder") { isPickingFolder = true }
                .disabled(model.isBusy)
        }
        .fileImporter(isPresented: $isPickingFolder, allowedContentTypes: [.folder]) { picked in
            if case .success(let folder) = picked { model.open(folder) }
        }
        .refreshable { model.refreshFiles() }
        .overlay {
            if model.isOpening {
                ProgressView("Opening… the first time compiles the Core ML model for this device")
                    .padding()
                    .background(.regularMaterial, in: .rect(cornerRadius: 12))
            }
        }
    }
}

struct BundleSummaryRows: View {
    let bundle: BundleSummary

    var body: some View {
        LabeledContent("Name", value: bundle.name)
        LabeledContent("Program", value: "\(bundle.backend) / \(bundle.delegate) (\(bundle.computeUnits))")
        LabeledContent("Context", value: "\(bundle.maxContext) tokens")
        LabeledContent("Drafter", value: bundle.hasDrafter ? "up to \(bundle.maxDraft) drafts a round" : "none")
        if !bundle.hasTokenizer {
            Text("No tokenizer.json in this bundle: it cannot take a text prompt.")
                .foregroundStyle(.secondary)
        }
    }
}
