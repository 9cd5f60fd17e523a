package dev.edgemtp.sample.bundle

import org.json.JSONArray
import org.json.JSONException
import org.json.JSONObject
import java.io.File
import java.io.IOException

/**
 * What the app reads of a bundle's manifest.json to choose and feed a runner: the backend and
 * delegate, the program, its methods and their output names, and the draft depths it allows.
 * The native engine reads the whole manifest itself (and refuses one it cannot decode).
 */
class BundleManifest(
    val dir: File,
    val backend: String,
    val delegate: String,
    val program: String,
    val methods: List<String>,
    val maxDraft: Int,
    val maxContext: Int,
    val hasDrafter: Boolean,
    private val outputNames: Map<String, List<String>>,
) {
    val name: String get() = dir.name
    val programFile: File get() = File(dir, program)

    /** The names of [method]'s outputs in order (manifest method_io). */
    fun outputNames(method: String): List<String> =
        outputNames[method] ?: throw IllegalArgumentException("$name has no method '$method'")

    companion object {
        const val FILE = "manifest.json"

        /** Reads [dir]/manifest.json; throws [BundleException] with one line naming the problem. */
        fun read(dir: File): BundleManifest {
            val file = File(dir, FILE)
            val json = try {
                JSONObject(file.readText())
            } catch (e: IOException) {
                throw BundleException("${file.path}: cannot read it (${e.message})")
            } catch (e: JSONException) {
                throw BundleException("${file.path}: not JSON (${e.message}); is this an edgemtp bundle?")
            }
            return try {
                parse(dir, json)
            } catch (e: JSONException) {
                throw BundleException("${file.path}: ${e.message}")
            }
        }

        private fun parse(dir: File, json: JSONObject): BundleManifest {
            val shapes = json.getJSONObject("shapes")
            val methodIo = json.getJSONObject("method_io")
            val outputs = methodIo.keys().asSequence().associateWith { method ->
                methodIo.getJSONObject(method).getJSONArray("outputs").names()
            }
            return BundleManifest(
                dir = dir,
                backend = json.getString("backend"),
                delegate = json.getString("delegate"),
                program = json.getString("program"),
                methods = json.getJSONObject("methods").keys().asSequence().sorted().toList(),
                maxDraft = shapes.getInt("max_draft"),
                maxContext = shapes.getInt("max_context"),
                hasDrafter = !json.isNull("drafter"),
                outputNames = outputs,
            )
        }

        // method_io entries are {"name", "shape", "dtype"} objects, [name, shape, dtype] lists or
        // bare names, depending on the exporter (as the engine's own reader accepts).
        private fun JSONArray.names(): List<String> = (0 until length()).map { i ->
            when (val entry = get(i)) {
                is JSONObject -> entry.getString("name")
                is JSONArray -> entry.getString(0)
                else -> entry.toString()
            }
        }
    }
}

/** A bundle the app cannot use, in one line. */
class BundleException(message: String) : Exception(message)
