package dev.edgemtp.sample.bench

import dev.edgemtp.sample.engine.BenchRequest

/** The benchmark plan as typed in the app, before [toRequest] checks it. */
data class BenchForm(
    val pp: String = "128,512",
    val tg: String = "128",
    val depths: String = "0,1,2,3",
    val repeat: String = "5",
    /** The devices/profiles name of this phone (e.g. pixel-10-pro), for the report's predictions. */
    val profile: String = "",
) {
    /** The plan, or a one-line reason it is not one; the engine checks it against the bundle. */
    fun toRequest(maxDraft: Int): Result<BenchRequest> = runCatching {
        val depthList = list("depths", depths, minimum = 0)
        depthList.firstOrNull { it > maxDraft }?.let {
            throw IllegalArgumentException("depth $it: this bundle drafts at most $maxDraft")
        }
        BenchRequest(
            pp = list("pp", pp, minimum = 1, allowEmpty = true),
            tg = list("tg", tg, minimum = 1, allowEmpty = true),
            depths = depthList,
            repeat = number("repeat", repeat, minimum = 1),
        )
    }

    /** The command line `edgemtp bench` would take for this plan, recorded in the result. */
    fun command(bundleName: String, threads: Int, request: BenchRequest): String =
        "edgemtp-android bench --bundle $bundleName --pp ${request.pp.joinToString(",")} " +
            "--tg ${request.tg.joinToString(",")} --mtp ${request.depths.joinToString(",")} " +
            "--repeat ${request.repeat} --threads $threads"

    private fun list(field: String, text: String, minimum: Int, allowEmpty: Boolean = false): List<Int> {
        val values = text.split(',').map { it.trim() }.filter { it.isNotEmpty() }
            .map { number(field, it, minimum) }
        require(allowEmpty || values.isNotEmpty()) { "$field: give at least one value" }
        return values
    }

    private fun number(field: String, text: String, minimum: Int): Int {
        val value = text.trim().toIntOrNull()
        require(value != null && value >= minimum) { "$field: '$text' is not an integer ≥ $minimum" }
        return value
    }
}
