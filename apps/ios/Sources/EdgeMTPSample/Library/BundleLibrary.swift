import Foundation

/// The bundles in the app's Documents folder, where Finder file sharing and the Files app put
/// them (UIFileSharingEnabled, LSSupportsOpeningDocumentsInPlace): every folder with a
/// manifest.json.
enum BundleLibrary {
    static func bundles() -> [URL] {
        let files = FileManager.default
        let items = (try? files.contentsOfDirectory(
            at: URL.documentsDirectory, includingPropertiesForKeys: nil, options: [.skipsHiddenFiles])) ?? []
        return items
            .filter { files.fileExists(atPath: $0.appending(path: "manifest.json").path(percentEncoded: false)) }
            .sorted { $0.lastPathComponent.localizedStandardCompare($1.lastPathComponent) == .orderedAscending }
    }
}

/// Keeps a folder picked in the Files app readable while the engine uses it: its tables are
/// memory-mapped and read as the model runs, not only when it opens.
final class SecurityScopedAccess {
    private let url: URL
    private let granted: Bool

    init(_ url: URL) {
        self.url = url
        granted = url.startAccessingSecurityScopedResource()  // false, and not needed, in Documents
    }

    deinit {
        if granted { url.stopAccessingSecurityScopedResource() }
    }
}
