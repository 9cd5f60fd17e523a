package dev.edgemtp.sample.engine

/** One generation's settings: the fields of the engine's GenerateOptions and SamplingParams. */
data class GenerationOptions(
    val maxNewTokens: Int = 128,
    /** 0: autoregressive; k: k drafts a round; [ADAPTIVE_DEPTH]: chosen round by round. */
    val depth: Int = ADAPTIVE_DEPTH,
    /** Wraps the prompt in the tokenizer's chat turn markers. */
    val chat: Boolean = false,
    /** 0: greedy. */
    val temperature: Double = 0.0,
    val topK: Int = 0,
    val topP: Double = 1.0,
    val minP: Double = 0.0,
    val seed: Long = 0,
) {
    companion object {
        const val ADAPTIVE_DEPTH = -1
    }
}
