import EdgeMTPCoreML

/// How many tokens the drafter proposes each round.
enum DraftDepth: Hashable, Sendable {
    case autoregressive
    case fixed(Int)
    case adaptive

    /// The core's GenerateOptions.depth: 0 autoregressive, k pinned, -1 adaptive.
    var engineValue: Int {
        switch self {
        case .autoregressive: 0
        case .fixed(let drafts): drafts
        case .adaptive: -1
        }
    }

    var label: String {
        switch self {
        case .autoregressive: "AR"
        case .fixed(let drafts): "\(drafts)"
        case .adaptive: "Adaptive"
        }
    }

    /// What a bundle can run: drafting needs its drafter, and a round verifies at most its
    /// max_draft drafts.
    static func choices(for bundle: BundleSummary?) -> [DraftDepth] {
        guard let bundle, bundle.hasDrafter, bundle.maxDraft > 0 else { return [.autoregressive] }
        return [.autoregressive] + (1...min(3, bundle.maxDraft)).map(DraftDepth.fixed) + [.adaptive]
    }
}

struct GenerationSettings: Sendable, Equatable {
    var depth = DraftDepth.adaptive
    var maxNewTokens = 128
    var temperature = 0.0  // 0: greedy, the tokens autoregressive decoding gives
    var topP = 1.0
    var chat = true
    var seed: UInt64 = 0

    var engineOptions: EMGenerateOptions {
        let options = EMGenerateOptions()
        options.depth = depth.engineValue
        options.maxNewTokens = maxNewTokens
        options.temperature = temperature
        options.topP = topP
        options.chat = chat
        options.seed = seed
        return options
    }
}
