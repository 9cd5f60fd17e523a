package dev.edgemtp.sample.runner

/**
 * Runs the methods of a bundle's program (ExecuTorch's model.pte, or ONNX Runtime sessions) for
 * the native engine, which calls [run] through JNI on its engine thread; everything else (tokens,
 * embedding rows, the host cache of ONNX bundles, sampling) is the engine's.
 */
interface BundleRunner : AutoCloseable {
    /**
     * Runs [method]. [inputs] are its inputs in the manifest's method_io order, then, for bundles
     * whose cache lives on the host (ONNX), its cache inputs in order; their buffers are engine
     * memory, valid during this call only, and are never written. Returns the method's outputs
     * in order, then its cache outputs, each over a direct buffer holding at least its bytes.
     */
    fun run(method: String, inputs: Array<NativeTensor>): Array<NativeTensor>
}
