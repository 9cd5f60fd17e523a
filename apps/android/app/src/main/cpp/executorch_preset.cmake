# What the app's ExecuTorch build contains (an ExecuTorch build preset: the options it leaves
# alone keep their defaults). The runtime, its Module and tensor extensions, XNNPACK with its
# weight cache (methods that share a weight share one packed copy instead of one each) and the
# optimized and quantized CPU kernels; no Java layer of its own.
set_overridable_option(BUILD_TESTING OFF)
set_overridable_option(EXECUTORCH_BUILD_ANDROID_JNI OFF)
set_overridable_option(EXECUTORCH_PAL_DEFAULT android)
set_overridable_option(EXECUTORCH_ENABLE_LOGGING ON)
set_overridable_option(EXECUTORCH_LOG_LEVEL Info)
set_overridable_option(EXECUTORCH_BUILD_XNNPACK ON)
set_overridable_option(EXECUTORCH_XNNPACK_ENABLE_WEIGHT_CACHE ON)
set_overridable_option(EXECUTORCH_XNNPACK_SHARED_WORKSPACE ON)
set_overridable_option(EXECUTORCH_BUILD_EXTENSION_DATA_LOADER ON)
set_overridable_option(EXECUTORCH_BUILD_EXTENSION_FLAT_TENSOR ON)
set_overridable_option(EXECUTORCH_BUILD_EXTENSION_MODULE ON)
set_overridable_option(EXECUTORCH_BUILD_EXTENSION_NAMED_DATA_MAP ON)
set_overridable_option(EXECUTORCH_BUILD_EXTENSION_TENSOR ON)
set_overridable_option(EXECUTORCH_BUILD_KERNELS_OPTIMIZED ON)
set_overridable_option(EXECUTORCH_BUILD_KERNELS_QUANTIZED ON)
