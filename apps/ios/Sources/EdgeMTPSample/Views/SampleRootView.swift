import SwiftUI

/// The whole app: the App target's only view.
public struct SampleRootView: View {
    @State private var model = SampleModel()

    public init() {}

    public var body: some View {
        @Bindable var model = model
        TabView {
            Tab("Bundle", systemImage: "shippingbox") {
                NavigationStack { BundleView() }
            }
            Tab("Generate", systemImage: "text.bubble") {
                NavigationStack { GenerateView() }
            }
            Tab("Bench", systemImage: "speedometer") {
                NavigationStack { BenchView() }
            }
            Tab("Device", systemImage: "thermometer.medium") {
                NavigationStack { DeviceView() }
            }
        }
        .environment(model)
        .alert("edgemtp", isPresented: $model.isShowingFailure) {
            Button("OK") {}
        } message: {
            Text(model.failure ?? "")
        }
        .task { model.refreshFiles() }
    }
}
