package dev.edgemtp.sample.engine

/** A benchmark plan, as `edgemtp bench --pp --tg --mtp --repeat` takes it (runtime/bench.py). */
data class BenchRequest(
    val pp: List<Int>,
    val tg: List<Int>,
    val depths: List<Int>,
    val repeat: Int,
    val tgPrompt: Int = 64,
    val seed: Long = 0,
)

/** One battery counter reading: the bench result's per-run "battery" (source, unit, value). */
class BatteryReading(val source: String, val value: Double, val unit: String)

/** The bench result's "machine" object (runtime/bench.schema.json). */
class MachineDescription(
    val platform: String,
    val device: String,
    /** The devices/profiles name this device matches; empty when none. */
    val profile: String,
    val cpu: String,
    val cores: Int,
    val memoryGib: Double,
    val os: String,
    val threads: Int,
    val libraryNames: Array<String>,
    val libraryVersions: Array<String>,
)
