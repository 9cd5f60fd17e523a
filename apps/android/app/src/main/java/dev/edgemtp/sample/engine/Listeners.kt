package dev.edgemtp.sample.engine

/** Called by the engine, on its thread, while it generates. */
interface GenerationListener {
    /** Newly completed text (whole UTF-8 characters) and the token ids committed with it. */
    fun onText(text: String, tokenIds: IntArray)

    /** Asked between decode rounds; true ends the generation with stop reason "interrupted". */
    fun shouldStop(): Boolean
}

/** Called by the engine, on its thread, while it runs a benchmark plan. */
interface BenchListener {
    /** Read before and after each run; null when the device reports no battery counter. */
    fun batteryReading(): BatteryReading?

    /** [done] of [planned] runs finished; [next] describes the coming one. */
    fun onProgress(done: Int, planned: Int, next: String)

    /** Asked before each run; true returns the runs so far. */
    fun shouldStop(): Boolean
}
