import EdgeMTPCoreML
import Foundation

/// The bench result's "machine" object: what an app can learn about the device it runs on.
struct MachineDescription: Sendable {
    var platform: String  // "ios", or "host" on a Mac
    var device: String    // the model identifier, e.g. "iPhone18,1"; empty on a Mac
    var profile: String   // a devices/profiles name the user chose, or empty
    var cpu: String
    var cores: Int
    var memoryGiB: Double
    var os: String
    var libraries: [String: String]

    static func current(profile: String) -> MachineDescription {
        let process = ProcessInfo.processInfo
        let version = process.operatingSystemVersion
        let osVersion = "\(version.majorVersion).\(version.minorVersion).\(version.patchVersion)"
        let app = Bundle.main.infoDictionary?["CFBundleShortVersionString"] as? String ?? "dev"
        #if os(iOS)
        let identifier = process.environment["SIMULATOR_MODEL_IDENTIFIER"] ?? systemValue("hw.machine")
        let (platform, device, osName) = ("ios", identifier ?? "", "iOS")
        #else
        let identifier = systemValue("hw.model")
        let (platform, device, osName) = ("host", "", "macOS")
        #endif
        return MachineDescription(
            platform: platform,
            device: device,
            profile: profile,
            cpu: systemValue("machdep.cpu.brand_string") ?? identifier ?? "Apple",
            cores: process.activeProcessorCount,
            memoryGiB: Double(process.physicalMemory) / 1_073_741_824,
            os: "\(osName) \(osVersion)",
            // Core ML ships with the OS: its version is the OS's.
            libraries: ["coreml": osVersion, "edgemtp-ios-sample": app])
    }

    var engineMachine: EMMachineInfo {
        let machine = EMMachineInfo()
        machine.platform = platform
        machine.device = device
        machine.profile = profile
        machine.cpu = cpu
        machine.cores = cores
        machine.memoryGiB = memoryGiB
        machine.os = os
        machine.threads = 1  // Core ML schedules its own threads; the app drives it from one
        machine.libraries = libraries
        return machine
    }
}

private func systemValue(_ name: String) -> String? {
    var size = 0
    guard sysctlbyname(name, nil, &size, nil, 0) == 0, size > 0 else { return nil }
    var bytes = [UInt8](repeating: 0, count: size)
    guard sysctlbyname(name, &bytes, &size, nil, 0) == 0 else { return nil }
    return String(decoding: bytes.prefix { $0 != 0 }, as: UTF8.self)
}
