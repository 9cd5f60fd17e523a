package dev.edgemtp.sample.ui

import dev.edgemtp.sample.battery.BatteryDrain
import dev.edgemtp.sample.bench.BenchForm
import dev.edgemtp.sample.bundle.BundleManifest
import dev.edgemtp.sample.engine.GenerationOptions
import dev.edgemtp.sample.engine.GenerationStats

enum class DepthChoice(val label: String, val depth: Int) {
    AR("AR", 0),
    ONE("1", 1),
    TWO("2", 2),
    THREE("3", 3),
    ADAPTIVE("adaptive", GenerationOptions.ADAPTIVE_DEPTH),
    ;

    companion object {
        /** The depths [bundle] can decode with: AR only without a drafter. */
        fun available(bundle: BundleManifest?): List<DepthChoice> =
            if (bundle == null || !bundle.hasDrafter) listOf(AR) else entries.filter { it.depth <= bundle.maxDraft }
    }
}

data class GenerationSettings(
    val depth: DepthChoice = DepthChoice.ADAPTIVE,
    /** 0: greedy (MTP then commits exactly the tokens autoregressive decoding would). */
    val temperature: Float = 0f,
    val topP: Float = 1f,
    val chat: Boolean = true,
    val maxNewTokens: Int = 128,
) {
    fun toOptions() = GenerationOptions(
        maxNewTokens = maxNewTokens,
        depth = depth.depth,
        chat = chat,
        temperature = temperature.toDouble(),
        topP = topP.toDouble(),
    )

    /** These settings with a depth [bundle] offers. */
    fun fittedTo(bundle: BundleManifest): GenerationSettings {
        val choices = DepthChoice.available(bundle)
        return if (depth in choices) this else copy(depth = choices.last())
    }
}

sealed interface BundleStatus {
    data object NoneSelected : BundleStatus

    data class Opening(val name: String) : BundleStatus

    data class Ready(val bundle: BundleManifest, val threads: Int) : BundleStatus

    data class Failed(val name: String, val message: String) : BundleStatus
}

data class GenerationUi(
    val output: String = "",
    val running: Boolean = false,
    val stats: GenerationStats? = null,
    val battery: BatteryDrain? = null,
    val error: String? = null,
)

data class BenchProgress(val done: Int, val planned: Int, val next: String)

data class BenchUi(
    val form: BenchForm = BenchForm(),
    val running: Boolean = false,
    val progress: BenchProgress? = null,
    val resultPath: String? = null,
    val error: String? = null,
)

data class SampleUiState(
    /** Where bundles are pushed; null while shared storage is unavailable. */
    val bundlesDir: String? = null,
    val bundleNames: List<String> = emptyList(),
    val bundle: BundleStatus = BundleStatus.NoneSelected,
    val threads: Int = 4,
    val prompt: String = "Explain speculative decoding in two sentences.",
    val settings: GenerationSettings = GenerationSettings(),
    val generation: GenerationUi = GenerationUi(),
    val bench: BenchUi = BenchUi(),
) {
    val busy: Boolean get() = generation.running || bench.running
    val openBundle: BundleManifest? get() = (bundle as? BundleStatus.Ready)?.bundle
}
