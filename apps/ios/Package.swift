// swift-tools-version: 6.0
// The edgemtp iOS sample: the shared C++ decode core, a Core ML method runner in Objective-C++,
// and the SwiftUI app's library. The app shell itself is the Xcode project App/project.yml
// generates (an iOS .app needs one); `swift build` on a Mac builds everything below.
import PackageDescription

let package = Package(
    name: "EdgeMTP",
    platforms: [.iOS(.v18), .macOS(.v15)],  // MLState and multifunction models need iOS 18 / macOS 15
    products: [
        .library(name: "EdgeMTPSample", targets: ["EdgeMTPSample"]),
        .executable(name: "edgemtp-ios-check", targets: ["edgemtp-ios-check"]),
    ],
    targets: [
        // apps/core, unchanged. SwiftPM only builds sources inside the package, so src and
        // include are symbolic links to ../../../core/{src,include}: every .cpp of the core is
        // compiled, as apps/core/CMakeLists.txt does, and nothing is copied that could go stale.
        .target(
            name: "EdgeMTPCore",
            path: "Sources/EdgeMTPCore",
            sources: ["src"],
            publicHeadersPath: "include"
        ),
        // The Core ML MethodRunner and an Objective-C face of the core's Engine and run_bench.
        // Its public headers are plain Objective-C, so Swift imports it without C++ interop.
        .target(
            name: "EdgeMTPCoreML",
            dependencies: ["EdgeMTPCore"],
            path: "Sources/EdgeMTPCoreML",
            publicHeadersPath: "include",
            linkerSettings: [.linkedFramework("CoreML")]
        ),
        // Everything the app shows and does, except its @main entry (App/Sources).
        .target(
            name: "EdgeMTPSample",
            dependencies: ["EdgeMTPCoreML"],
            path: "Sources/EdgeMTPSample"
        ),
        // A command-line check for a Mac (macOS 15+): the app's runner and engine on a bundle,
        // with no app signing or device.
        .executableTarget(
            name: "edgemtp-ios-check",
            dependencies: ["EdgeMTPCoreML"],
            path: "Sources/edgemtp-ios-check"
        ),
    ],
    swiftLanguageModes: [.v6],
    cxxLanguageStandard: .cxx17
)
