package dev.edgemtp.sample.bundle

import android.content.Context
import java.io.File

/**
 * The bundle folders pushed under the app's external files, e.g.
 * `adb push out/e2b-q-pte /sdcard/Android/data/dev.edgemtp.sample/files/bundles/e2b-q-pte`.
 */
class BundleLibrary(context: Context) {
    /** Null while shared storage is unavailable. */
    val root: File? = context.getExternalFilesDir(DIR)

    /** Folders directly under [root] that hold a manifest.json, by name. */
    fun list(): List<File> = root?.listFiles()
        ?.filter { File(it, BundleManifest.FILE).isFile }
        ?.sortedBy { it.name }
        .orEmpty()

    companion object {
        const val DIR = "bundles"
    }
}
