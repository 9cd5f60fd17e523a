package dev.edgemtp.sample.runner

import ai.onnxruntime.OrtEnvironment
import ai.onnxruntime.OrtProvider
import android.content.Context
import android.system.Os
import dev.edgemtp.sample.BuildConfig
import dev.edgemtp.sample.bundle.BundleException
import dev.edgemtp.sample.bundle.BundleManifest
import dev.edgemtp.sample.engine.NativeEngine

/**
 * Opens the engine with the runner for a bundle's backend and delegate, or says why this build
 * cannot run it.
 */
object RunnerFactory {
    fun open(context: Context, bundle: BundleManifest, threads: Int): NativeEngine =
        when (bundle.backend) {
            "executorch" -> openExecuTorch(context, bundle, threads)
            "onnx" -> openOnnx(context, bundle, threads)
            "coreml" -> throw BundleException(
                "${bundle.name} is a Core ML bundle: it runs in the iOS app; export with " +
                    "--backend executorch or onnx for Android",
            )
            else -> throw BundleException("${bundle.name}: unknown backend '${bundle.backend}'")
        }

    /** The runtime libraries this build runs a bundle with, for the benchmark's "machine". */
    fun libraries(bundle: BundleManifest): Map<String, String> = when (bundle.backend) {
        "executorch" -> mapOf("executorch" to BuildConfig.EXECUTORCH_VERSION)
        "onnx" -> mapOf("onnxruntime" to BuildConfig.ONNXRUNTIME_VERSION)
        else -> emptyMap()
    } + ("edgemtp-android" to BuildConfig.VERSION_NAME)

    // ExecuTorch runs inside the native library, with edgemtp's own kernels (`--kernels edgemtp`
    // bundles) registered beside XNNPACK.
    private fun openExecuTorch(context: Context, bundle: BundleManifest, threads: Int): NativeEngine {
        when (bundle.delegate) {
            "cpu" -> Unit
            "htp" -> {
                if (!BuildConfig.QNN) {
                    throw BundleException(
                        "${bundle.name} targets the Qualcomm HTP: install the app's qnn build " +
                            "(./gradlew :app:installQnnRelease -PqnnSdkRoot=...), which builds in ExecuTorch's QNN backend",
                    )
                }
                prepareQnn(context)
            }
            else -> throw BundleException(
                "${bundle.name} uses ExecuTorch's Core ML delegate (${bundle.delegate}): it runs on Apple devices only",
            )
        }
        return NativeEngine(bundle.dir, bundle.programFile, threads)
    }

    private fun openOnnx(context: Context, bundle: BundleManifest, threads: Int): NativeEngine {
        val useQnn = when (bundle.delegate) {
            "cpu" -> false
            "htp" -> {
                if (OrtProvider.QNN !in OrtEnvironment.getAvailableProviders()) {
                    throw BundleException(
                        "${bundle.name} targets the Qualcomm HTP through ONNX Runtime's QNN EP, " +
                            "which this build's onnxruntime-android lacks (see the README: onnxruntime-android-qnn)",
                    )
                }
                prepareQnn(context)
                true
            }
            else -> throw BundleException("${bundle.name}: ONNX bundles have no '${bundle.delegate}' delegate")
        }
        return NativeEngine(bundle.dir, OnnxRuntimeRunner(bundle.programFile, threads, useQnn))
    }

    // QNN's FastRPC loader finds the Hexagon "skel" libraries through ADSP_LIBRARY_PATH; the
    // QNN runtime AAR installs them into the app's native library folder.
    private fun prepareQnn(context: Context) {
        Os.setenv("ADSP_LIBRARY_PATH", context.applicationInfo.nativeLibraryDir, true)
    }
}
