package dev.edgemtp.sample.bench

import android.content.Context
import org.json.JSONObject
import java.io.File
import java.io.IOException

/**
 * Where the benchmark mode leaves its results: getExternalFilesDir("bench"), that is
 * /sdcard/Android/data/dev.edgemtp.sample/files/bench, the folder `edgemtp bench collect --adb`
 * pulls (runtime/bench_report.py's ANDROID_RESULTS), one JSON document per run of a plan.
 */
object BenchResults {
    const val DIR = "bench"

    private val unsafeInName = Regex("[^A-Za-z0-9._-]+")

    /**
     * The file name `edgemtp bench collect` gives a result in its report (bench_report.py's
     * _result_name), so a result keeps its name from the phone to the report.
     */
    fun fileName(bundleName: String, device: String, createdUtc: String): String {
        val where = device.ifEmpty { "host" }
        val stamp = createdUtc.replace(":", "").replace("-", "")
        return unsafeInName.replace("$bundleName-$where-$stamp", "-") + ".json"
    }

    /** Writes the result document [json] into the bench folder and returns its file. */
    fun write(context: Context, json: String): File {
        val dir = context.getExternalFilesDir(DIR) ?: throw IOException("shared storage is not available")
        val doc = JSONObject(json)
        val machine = doc.getJSONObject("machine")
        val device = if (machine.isNull("device")) "" else machine.getString("device")
        val name = fileName(doc.getJSONObject("bundle").getString("name"), device, doc.getString("created"))
        val file = File(dir, name)
        // Written beside it first, so that a pull never sees half a document under a .json name.
        val partial = File(dir, "$name.partial")
        partial.writeText(json)
        if (!partial.renameTo(file)) throw IOException("cannot rename ${partial.path} to ${file.name}")
        return file
    }
}
