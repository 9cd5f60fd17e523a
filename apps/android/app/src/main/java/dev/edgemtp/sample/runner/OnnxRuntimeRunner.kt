package dev.edgemtp.sample.runner

import ai.onnxruntime.OnnxTensor
import ai.onnxruntime.OrtEnvironment
import ai.onnxruntime.OrtSession
import org.json.JSONArray
import org.json.JSONObject
import java.io.File

/**
 * Runs an `onnx` bundle: one ONNX Runtime session per method file (`onnx/<method>.onnx`, all
 * sharing `onnx/weights.bin`), configured as runtime/runners/onnx.py's OnnxRunner configures its
 * own: [threads] intra-op threads, one inter-op thread, and methods.json's session config entries.
 *
 * The cache lives on the host in the engine, which passes it after the logical inputs and writes
 * back the rows a method returns; inputs are wrapped without a copy, and outputs are written by
 * ONNX Runtime straight into buffers bound once per method ("pinned" outputs).
 */
class OnnxRuntimeRunner(programDir: File, threads: Int, useQnn: Boolean) : BundleRunner {
    private val environment = OrtEnvironment.getEnvironment()
    private val options = OrtSession.SessionOptions()
    private val methods: Map<String, OnnxMethod>

    init {
        val index = JSONObject(File(programDir, INDEX).readText())
        options.setIntraOpNumThreads(threads)
        options.setInterOpNumThreads(1)
        // Denormals read and written as zero on ONNX Runtime's threads, as OnnxRunner runs them:
        // a softmax over peaked scores leaves probabilities below 1e-38 that slow the next matmul.
        options.addConfigEntry("session.set_denormal_as_zero", "1")
        val config = index.getJSONObject("session_config")
        config.keys().forEach { key -> options.addConfigEntry(key, config.getString(key)) }
        if (useQnn) options.addQnn(mapOf("backend_path" to QNN_HTP_LIBRARY))
        val specs = index.getJSONObject("methods")
        methods = specs.keys().asSequence().associateWith { name ->
            OnnxMethod(name, specs.getJSONObject(name), programDir)
        }
    }

    override fun run(method: String, inputs: Array<NativeTensor>): Array<NativeTensor> {
        val target = methods[method] ?: throw IllegalArgumentException("the program has no method '$method'")
        return target.run(inputs)
    }

    override fun close() {
        methods.values.forEach { it.close() }
        options.close()
    }

    private inner class OnnxMethod(private val name: String, spec: JSONObject, programDir: File) {
        private val session = environment.createSession(File(programDir, spec.getString("file")).path, options)
        private val inputNames = spec.getJSONArray("inputs").names() + spec.getJSONArray("cache_inputs").strings()
        private val outputs: List<NativeTensor> =
            (spec.getJSONArray("outputs").tensors() + spec.getJSONArray("cache_outputs").tensors())
        private val pinned: Map<String, OnnxTensor> = outputs.associate { it.name to it.toOnnx() }

        fun run(inputs: Array<NativeTensor>): Array<NativeTensor> {
            require(inputs.size == inputNames.size) {
                "$name takes ${inputNames.size} inputs (with the cache); the engine passed ${inputs.size}"
            }
            val feeds = inputNames.zip(inputs) { inputName, tensor -> inputName to tensor.toOnnx() }.toMap()
            try {
                session.run(feeds, pinned).close() // a Result never closes pinned outputs
            } finally {
                feeds.values.forEach { it.close() } // frees the wrappers, not the engine's memory
            }
            return outputs.toTypedArray()
        }

        fun close() {
            pinned.values.forEach { it.close() }
            session.close()
        }
    }

    // A direct buffer is wrapped, not copied: ONNX Runtime reads and writes the engine's memory.
    private fun NativeTensor.toOnnx(): OnnxTensor = when (dtype) {
        NativeTensor.FLOAT32 -> OnnxTensor.createTensor(environment, floats(), shape)
        else -> OnnxTensor.createTensor(environment, longs(), shape)
    }

    private companion object {
        const val INDEX = "methods.json" // runtime/runners/onnx.py's INDEX
        const val QNN_HTP_LIBRARY = "libQnnHtp.so"

        fun JSONArray.names(): List<String> = (0 until length()).map { getJSONObject(it).getString("name") }

        fun JSONArray.strings(): List<String> = (0 until length()).map { getString(it) }

        fun JSONArray.tensors(): List<NativeTensor> = (0 until length()).map { i ->
            val io = getJSONObject(i)
            val shape = io.getJSONArray("shape")
            NativeTensor.allocate(
                name = io.getString("name"),
                dtype = NativeTensor.dtypeCode(io.getString("dtype")),
                shape = LongArray(shape.length()) { shape.getLong(it) },
            )
        }
    }
}
