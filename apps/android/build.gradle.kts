buildscript {
    repositories {
        mavenCentral()
    }
    dependencies {
        // Pins the Kotlin that AGP's built-in Kotlin compiles with to the catalog's version, the
        // one the Compose compiler plugin below must match.
        classpath(libs.kotlin.gradle.plugin)
    }
}

plugins {
    alias(libs.plugins.android.application) apply false
    alias(libs.plugins.kotlin.compose) apply false
}
