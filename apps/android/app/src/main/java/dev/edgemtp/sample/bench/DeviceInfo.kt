package dev.edgemtp.sample.bench

import android.app.ActivityManager
import android.content.Context
import android.os.Build
import dev.edgemtp.sample.engine.MachineDescription
import kotlin.math.roundToInt

/** What the app knows of the phone, as the bench result's "machine". */
object DeviceInfo {
    fun describe(context: Context, threads: Int, profile: String, libraries: Map<String, String>): MachineDescription {
        val memory = ActivityManager.MemoryInfo()
        context.getSystemService(ActivityManager::class.java)?.getMemoryInfo(memory)
        return MachineDescription(
            platform = "android",
            device = deviceName(),
            profile = profile.trim(),
            cpu = cpuName(),
            cores = Runtime.getRuntime().availableProcessors(),
            memoryGib = (memory.totalMem / GIB * 10).roundToInt() / 10.0,
            os = "Android ${Build.VERSION.RELEASE} (API ${Build.VERSION.SDK_INT})",
            threads = threads,
            libraryNames = libraries.keys.toTypedArray(),
            libraryVersions = libraries.values.toTypedArray(),
        )
    }

    /** E.g. "Pixel 10 Pro", or "samsung SM-S948B" where the model is a part number. */
    fun deviceName(): String {
        val named = Build.MANUFACTURER.equals("Google", ignoreCase = true) ||
            Build.MODEL.startsWith(Build.MANUFACTURER, ignoreCase = true)
        return if (named) Build.MODEL else "${Build.MANUFACTURER} ${Build.MODEL}"
    }

    private fun cpuName(): String =
        if (Build.VERSION.SDK_INT >= Build.VERSION_CODES.S && Build.SOC_MODEL != Build.UNKNOWN) {
            "${Build.SOC_MANUFACTURER} ${Build.SOC_MODEL}"
        } else {
            Build.HARDWARE
        }

    private const val GIB = 1024.0 * 1024.0 * 1024.0
}
