import Foundation

/// Bench results live in Documents/bench, which Finder file sharing and the Files app show: copy
/// the folder off the phone and run `edgemtp bench collect --from bench`.
enum BenchResultFile {
    static var folder: URL { URL.documentsDirectory.appending(path: "bench", directoryHint: .isDirectory) }

    /// `edgemtp bench collect` keeps a result's file name, so the app names a result as
    /// runtime/bench_report.py's _result_name does: "<bundle>-<device or host>-<created without
    /// ':' and '-'>", every run of characters outside [A-Za-z0-9._-] made one '-', then ".json".
    static func name(bundle: String, device: String?, created: String) -> String {
        let machine = device.flatMap { $0.isEmpty ? nil : $0 } ?? "host"
        let stamp = created.replacing(":", with: "").replacing("-", with: "")
        let raw = "\(bundle)-\(machine)-\(stamp)"
        return raw.replacing(#/[^A-Za-z0-9._-]+/#, with: "-") + ".json"
    }

    /// Writes a result document (the core's JSON) under the name its own fields give it.
    static func write(_ json: String) throws -> URL {
        guard let document = try JSONSerialization.jsonObject(with: Data(json.utf8)) as? [String: Any],
              let bundle = (document["bundle"] as? [String: Any])?["name"] as? String,
              let created = document["created"] as? String
        else { throw CocoaError(.fileWriteInvalidFileName) }
        let device = (document["machine"] as? [String: Any])?["device"] as? String
        try FileManager.default.createDirectory(at: folder, withIntermediateDirectories: true)
        let file = folder.appending(path: name(bundle: bundle, device: device, created: created))
        try Data(json.utf8).write(to: file, options: .atomic)
        return file
    }

    /// The results on this device, newest first.
    static func all() -> [URL] {
        let files = (try? FileManager.default.contentsOfDirectory(
            at: folder, includingPropertiesForKeys: [.contentModificationDateKey], options: [.skipsHiddenFiles])) ?? []
        func modified(_ url: URL) -> Date {
            (try? url.resourceValues(forKeys: [.contentModificationDateKey]).contentModificationDate) ?? .distantPast
        }
        return files.filter { $0.pathExtension == "json" }.sorted { modified($0) > modified($1) }
    }
}
