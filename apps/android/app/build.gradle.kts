plugins {
    alias(libs.plugins.android.application)
    alias(libs.plugins.kotlin.compose)
}

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
            cmake { arguments += "-DANDROID_STL=c++_static" }
        }
        buildConfigField("String", "ONNXRUNTIME_VERSION", "\"${libs.versions.onnxruntime.get()}\"")
    }

    // One flavor per ExecuTorch AAR: both have the same classes, so exactly one goes in an APK.
    // Both keep the application id, so the bench folder stays where `bench collect` looks.
    flavorDimensions += "accelerator"
    productFlavors {
        create("cpu") {
            dimension = "accelerator"
            buildConfigField("boolean", "QNN", "false")
            buildConfigField("String", "EXECUTORCH_VERSION", "\"${libs.versions.executorch.get()}\"")
            ndk { abiFilters += listOf("arm64-v8a", "x86_64") } // x86_64: the emulator, for the UI
        }
        create("qnn") {
            dimension = "accelerator"
            buildConfigField("boolean", "QNN", "true")
            buildConfigField("String", "EXECUTORCH_VERSION", "\"${libs.versions.executorchQnn.get()}\"")
            ndk { abiFilters += "arm64-v8a" } // the only ABI of Qualcomm's HTP libraries
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
            // ExecuTorch (through fbjni) and ONNX Runtime may each ship the NDK's libc++_shared.
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
    "cpuImplementation"(libs.executorch.android)
    "qnnImplementation"(libs.executorch.android.qnn)
}
