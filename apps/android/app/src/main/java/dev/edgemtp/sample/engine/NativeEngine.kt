package dev.edgemtp.sample.engine

import dev.edgemtp.sample.runner.BundleRunner
import java.io.File

/**
 * The shared C++ decode engine (apps/core) over one bundle: tokenizing, embedding rows,
 * prefill, MTP decoding, sampling and timing. An ExecuTorch bundle's methods run inside the
 * native library (ExecuTorch's C++ runtime, its methods sharing the program's cache); an ONNX
 * bundle's run through a Kotlin [BundleRunner], which the engine then owns and closes.
 *
 * Calls block and must not overlap: [EngineSession] serializes them on one thread. Errors
 * arrive as [EngineException] (one line); an exception a runner or listener throws arrives as
 * itself.
 */
class NativeEngine private constructor(private val runner: BundleRunner?) : AutoCloseable {
    private var handle: Long = 0L

    /** Runs [bundleDir]'s methods through [runner]; closes it if the engine cannot open. */
    constructor(bundleDir: File, runner: BundleRunner) : this(runner) {
        handle = opening { nativeOpen(bundleDir.path, runner) }
    }

    /** Runs an ExecuTorch bundle's [program] in the native library on [threads] threads. */
    constructor(bundleDir: File, program: File, threads: Int) : this(null) {
        handle = nativeOpenExecuTorch(bundleDir.path, program.path, threads)
    }

    private fun opening(open: () -> Long): Long = try {
        open()
    } catch (e: Throwable) {
        runner?.close()
        throw e
    }

    fun generate(prompt: String, options: GenerationOptions, listener: GenerationListener): GenerationStats =
        nativeGenerate(
            openHandle(), prompt, options.maxNewTokens, options.depth, options.chat,
            options.temperature, options.topK, options.topP, options.minP, options.seed, listener,
        )

    /** Runs [request] and returns the result document (runtime/bench.schema.json) as JSON. */
    fun bench(
        bundleDir: File,
        request: BenchRequest,
        machine: MachineDescription,
        command: String,
        createdUtc: String,
        listener: BenchListener,
    ): String = nativeBench(
        openHandle(), bundleDir.path, request.pp.toIntArray(), request.tg.toIntArray(),
        request.depths.toIntArray(), request.repeat, request.tgPrompt, request.seed, machine,
        command, createdUtc, listener,
    )

    /** Forgets the cache: the next prompt is prefilled from position 0. */
    fun reset() = nativeReset(openHandle())

    override fun close() {
        if (handle != 0L) {
            nativeClose(handle)
            handle = 0L
            runner?.close()
        }
    }

    private fun openHandle(): Long = handle.also { check(it != 0L) { "the engine is closed" } }

    private external fun nativeOpen(bundleDir: String, runner: BundleRunner): Long

    private external fun nativeOpenExecuTorch(bundleDir: String, program: String, threads: Int): Long

    private external fun nativeGenerate(
        handle: Long,
        prompt: String,
        maxNewTokens: Int,
        depth: Int,
        chat: Boolean,
        temperature: Double,
        topK: Int,
        topP: Double,
        minP: Double,
        seed: Long,
        listener: GenerationListener,
    ): GenerationStats

    private external fun nativeBench(
        handle: Long,
        bundleDir: String,
        pp: IntArray,
        tg: IntArray,
        depths: IntArray,
        repeat: Int,
        tgPrompt: Int,
        seed: Long,
        machine: MachineDescription,
        command: String,
        createdUtc: String,
        listener: BenchListener,
    ): String

    private external fun nativeReset(handle: Long)

    private external fun nativeClose(handle: Long)

    private companion object {
        init {
            System.loadLibrary("edgemtp_jni")
        }
    }
}
