package dev.edgemtp.sample.engine

/**
 * One generation's measurements as the engine reports them (edgemtp::GenerateStats); built by
 * the JNI bridge, so the constructor's parameters are its contract.
 */
class GenerationStats(
    val promptTokens: Int,
    /** Leading prompt tokens whose cache an earlier generation left (not prefilled again). */
    val reusedTokens: Int,
    val tokens: IntArray,
    val text: String,
    /** "stop", "length", "context" or "interrupted". */
    val stopReason: String,
    val ttftSeconds: Double,
    val decodeSeconds: Double,
    val prefillTokensPerSecond: Double,
    /** (tokens - 1) / decode time: the first token belongs to the time to first token. */
    val decodeTokensPerSecond: Double,
    /** Accepted drafts / drafted tokens over the rounds; 0 without drafts. */
    val acceptance: Double,
    val draftedPerRound: IntArray,
    val acceptedPerRound: IntArray,
    val phaseNames: Array<String>,
    val phaseSeconds: DoubleArray,
) {
    val rounds: Int get() = draftedPerRound.size

    /** Tokens committed per target forward (1 for autoregressive decoding). */
    val tokensPerRound: Double
        get() = if (rounds == 0) 0.0 else (tokens.size - 1).toDouble() / rounds
}
