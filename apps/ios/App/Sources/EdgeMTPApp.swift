import EdgeMTPSample
import SwiftUI

@main
struct EdgeMTPApp: App {
    var body: some Scene {
        WindowGroup {
            SampleRootView()
        }
    }
}
