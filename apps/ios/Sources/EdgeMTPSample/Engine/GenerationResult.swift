import EdgeMTPCoreML

/// One finished generation's figures, in `edgemtp bench`'s terms (the core's GenerateStats).
struct GenerationResult: Sendable, Equatable {
    var promptTokens: Int
    var generatedTokens: Int
    var stopReason: String
    var ttftSeconds: Double
    var prefillTokensPerSecond: Double
    var decodeTokensPerSecond: Double  // (tokens - 1) / (last token - first token)
    var acceptance: Double?  // accepted drafts / drafted ones; nil when nothing was drafted
    var drafted: Int
    var accepted: Int
    var rounds: Int

    init(_ stats: EMGenerateStats) {
        promptTokens = stats.promptTokens
        generatedTokens = stats.generatedTokens
        stopReason = stats.stopReason
        ttftSeconds = stats.ttftSeconds
        prefillTokensPerSecond = stats.prefillTokensPerSecond
        decodeTokensPerSecond = stats.decodeTokensPerSecond
        acceptance = stats.drafted > 0 ? stats.acceptance : nil
        drafted = stats.drafted
        accepted = stats.accepted
        rounds = stats.rounds
    }

    /// Tokens each target forward committed: acceptance length is not speedup, so both show.
    var tokensPerRound: Double? { rounds > 0 ? Double(rounds + accepted) / Double(rounds) : nil }
}
