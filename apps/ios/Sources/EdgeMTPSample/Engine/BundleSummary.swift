import EdgeMTPCoreML

/// What the opened bundle is, as its manifest says.
struct BundleSummary: Sendable, Equatable {
    var name: String
    var backend: String
    var delegate: String
    var computeUnits: String
    var maxContext: Int
    var maxDraft: Int
    var hasDrafter: Bool
    var hasTokenizer: Bool

    init(_ info: EMBundleInfo) {
        name = info.name
        backend = info.backend
        delegate = info.delegate
        computeUnits = info.computeUnits
        maxContext = info.maxContext
        maxDraft = info.maxDraft
        hasDrafter = info.hasDrafter
        hasTokenizer = info.hasTokenizer
    }
}
