package dev.edgemtp.sample.runner

import dev.edgemtp.sample.bundle.BundleManifest
import org.pytorch.executorch.DType
import org.pytorch.executorch.EValue
import org.pytorch.executorch.Module
import org.pytorch.executorch.Tensor

/**
 * Runs an `executorch` bundle's model.pte with ExecuTorch's Android Module (XNNPACK on the CPU;
 * the QNN build flavor also runs `htp` bundles). The KV cache is a mutable buffer inside the
 * program, shared by every method, so a method takes only its logical inputs.
 */
class ExecuTorchRunner(private val bundle: BundleManifest, threads: Int) : BundleRunner {
    private val module: Module = Module.load(bundle.programFile.path, Module.LOAD_MODE_MMAP, threads)

    // Output tensors reused per method: the engine copies them before its next call.
    private val outputs = HashMap<String, Array<NativeTensor?>>()

    init {
        // Loading (and, for XNNPACK, packing weights) up front keeps it out of the first
        // generation's time to first token.
        bundle.methods.forEach { module.loadMethod(it) }
    }

    override fun run(method: String, inputs: Array<NativeTensor>): Array<NativeTensor> {
        val values = Array(inputs.size) { i -> EValue.from(inputs[i].toExecuTorch()) }
        val results = module.execute(method, *values)
        val names = bundle.outputNames(method)
        check(results.size == names.size) {
            "$method returned ${results.size} outputs; the manifest declares ${names.size}"
        }
        val reused = outputs.getOrPut(method) { arrayOfNulls(names.size) }
        return Array(results.size) { i ->
            copyOut(results[i].toTensor(), names[i], reused[i]).also { reused[i] = it }
        }
    }

    override fun close() = module.destroy()

    private fun NativeTensor.toExecuTorch(): Tensor = when (dtype) {
        NativeTensor.FLOAT32 -> Tensor.fromBlob(floats(), shape)
        else -> Tensor.fromBlob(longs(), shape)
    }

    // The AAR hands out a tensor's elements as an array copy (its raw buffer is not public),
    // so each output is copied once more into a direct buffer the engine can read.
    private fun copyOut(tensor: Tensor, name: String, previous: NativeTensor?): NativeTensor {
        val shape = tensor.shape()
        val dtype = when (tensor.dtype()) {
            DType.FLOAT -> NativeTensor.FLOAT32
            DType.INT64 -> NativeTensor.INT64
            else -> throw IllegalStateException(
                "output '$name' is ${tensor.dtype()}: the engine takes float32 and int64",
            )
        }
        val target = previous?.takeIf { it.dtype == dtype && it.shape.contentEquals(shape) }
            ?: NativeTensor.allocate(name, dtype, shape)
        if (dtype == NativeTensor.FLOAT32) {
            target.floats().put(tensor.dataAsFloatArray)
        } else {
            target.longs().put(tensor.dataAsLongArray)
        }
        return target
    }
}
