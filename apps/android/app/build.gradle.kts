plugins {
    alias(libs.plugins.android.application)
    alias(libs.plugins.kotlin.compose)
}

// ExecuTorch is built from source into the native library (src/main/cpp/CMakeLists.txt): a local
// checkout of the catalog's release when given, else CMake fetches the tag.
val executorchSourceDir: String? =
    (findProperty("executorchSourceDir") as String?) ?: System.getenv("EXECUTORCH_SOURCE_DIR")
// Qualcomm's QNN SDK (QAIRT), for the qnn flavor: ExecuTorch's QNN backend and the HTP libraries.
val qnnSdkRoot: String? = (findProperty("qnnSdkRoot") as String?) ?: System.getenv("QNN_SDK_ROOT")

android {
    namespace = "dev.edgemtp.sample"
    compileSdk = libs.versions.compileSdk.get().toInt()
    ndkVersion = libs.versions.ndk.get()

    defaultConfig {
        // The bench folder edgemtp's `bench collect --adb` pulls is named after this id.
        applicationId = "dev.edgemtp.sample"
        minSdk = libs.versions.minSdk.get().toInt()
        targetSdk = libs.versions.targetSdk.get().toInt()
        versionCode = 1
        versionName = "0.1.0"

        externalNativeBuild {
            cmake {
                arguments += listOf(
                    "-DANDROID_STL=c++_static",
                    "-DEDGEMTP_EXECUTORCH_VERSION=${libs.versions.executorch.get()}",
                )
                executorchSourceDir?.let { arguments += "-DEDGEMTP_EXECUTORCH_SOURCE_DIR=$it" }
            }
        }
        buildConfigField("String", "ONNXRUNTIME_VERSION", "\"${libs.versions.onnxruntime.get()}\"")
        buildConfigField("String", "EXECUTORCH_VERSION", "\"${libs.versions.executorch.get()}\"")
    }

    // cpu: ExecuTorch with XNNPACK and edgemtp's kernels; qnn: the same plus ExecuTorch's QNN
    // backend and Qualcomm's HTP libraries. Both keep the application id, so the bench folder
    // stays where `bench collect` looks.
    flavorDimensions += "accelerator"
    productFlavors {
        create("cpu") {
            dimension = "accelerator"
            buildConfigField("boolean", "QNN", "false")
            ndk { abiFilters += listOf("arm64-v8a", "x86_64") } // x86_64: the emulator, for the UI
        }
        create("qnn") {
            dimension = "accelerator"
            buildConfigField("boolean", "QNN", "true")
            ndk { abiFilters += "arm64-v8a" } // the only ABI of Qualcomm's HTP libraries
            externalNativeBuild {
                cmake {
                    arguments += "-DEDGEMTP_QNN=ON"
                    qnnSdkRoot?.let { arguments += "-DQNN_SDK_ROOT=$it" }
                }
            }
        }
    }

    buildTypes {
        release {
            isMinifyEnabled = false
            proguardFiles(getDefaultProguardFile("proguard-android-optimize.txt"), "proguard-rules.pro")
            signingConfig = signingConfigs.getByName("debug") // a sample: installable as built
        }
    }

    compileOptions {
        sourceCompatibility = JavaVersion.VERSION_17
        targetCompatibility = JavaVersion.VERSION_17
    }

    buildFeatures {
        compose = true
        buildConfig = true
    }

    externalNativeBuild {
        cmake {
            path = file("src/main/cpp/CMakeLists.txt")
            version = libs.versions.cmake.get()
        }
    }

    packaging {
        jniLibs {
            // QNN's Hexagon libraries must be files on disk for the DSP loader to open them.
            useLegacyPackaging = true
            // ONNX Runtime's AAR may ship the NDK's libc++_shared (ours links libc++ statically).
            pickFirsts += "lib/*/libc++_shared.so"
        }
    }
}

dependencies {
    implementation(libs.androidx.core.ktx)
    implementation(libs.androidx.activity.compose)
    implementation(libs.androidx.lifecycle.viewmodel.compose)
    implementation(libs.androidx.lifecycle.runtime.compose)
    implementation(platform(libs.compose.bom))
    implementation(libs.compose.ui)
    implementation(libs.compose.foundation)
    implementation(libs.compose.material3)
    implementation(libs.kotlinx.coroutines.android)

    implementation(libs.onnxruntime.android)
}

// The qnn flavor packs the QNN SDK's Android and Hexagon (unsigned skel) libraries, which the
// HTP backend opens at run time, into the APK's native library folder.
val qnnLibraries = layout.buildDirectory.dir("qnn-jniLibs")
val copyQnnLibraries by tasks.registering(Sync::class) {
    val sdk = qnnSdkRoot
    doFirst {
        check(sdk != null) {
            "the qnn flavor needs Qualcomm's QNN SDK: pass -PqnnSdkRoot=/path/to/qairt/<version> " +
                "or set QNN_SDK_ROOT"
        }
    }
    if (sdk != null) {
        from("$sdk/lib/aarch64-android") { include("libQnnHtp*.so", "libQnnSystem.so") }
        from(fileTree("$sdk/lib").matching { include("hexagon-v*/unsigned/libQnnHtpV*Skel.so") }) {
            eachFile { path = name }
        }
    }
    into(qnnLibraries.map { it.dir("arm64-v8a") })
}
android.sourceSets.getByName("qnn").jniLibs.srcDir(qnnLibraries)
tasks.matching { it.name.startsWith("merge") && it.name.contains("Qnn") && it.name.endsWith("JniLibFolders") }
    .configureEach { dependsOn(copyQnnLibraries) }
