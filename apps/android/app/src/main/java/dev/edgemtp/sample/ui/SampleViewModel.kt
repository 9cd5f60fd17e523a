package dev.edgemtp.sample.ui

import android.app.Application
import androidx.lifecycle.AndroidViewModel
import androidx.lifecycle.viewModelScope
import dev.edgemtp.sample.battery.BatteryMonitor
import dev.edgemtp.sample.battery.measureBattery
import dev.edgemtp.sample.bench.BenchForm
import dev.edgemtp.sample.bench.BenchResults
import dev.edgemtp.sample.bench.DeviceInfo
import dev.edgemtp.sample.bench.toBenchReading
import dev.edgemtp.sample.bundle.BundleException
import dev.edgemtp.sample.bundle.BundleLibrary
import dev.edgemtp.sample.bundle.BundleManifest
import dev.edgemtp.sample.engine.EngineSession
import dev.edgemtp.sample.runner.RunnerFactory
import kotlinx.coroutines.CancellationException
import kotlinx.coroutines.Dispatchers
import kotlinx.coroutines.flow.MutableStateFlow
import kotlinx.coroutines.flow.StateFlow
import kotlinx.coroutines.flow.asStateFlow
import kotlinx.coroutines.flow.update
import kotlinx.coroutines.launch
import kotlinx.coroutines.withContext
import java.io.File
import java.time.Instant
import java.time.temporal.ChronoUnit

class SampleViewModel(application: Application) : AndroidViewModel(application) {
    private val library = BundleLibrary(application)
    private val battery = BatteryMonitor(application)
    private var session: EngineSession? = null

    private val _state = MutableStateFlow(
        SampleUiState(threads = Runtime.getRuntime().availableProcessors().coerceAtMost(DEFAULT_THREADS)),
    )
    val state: StateFlow<SampleUiState> = _state.asStateFlow()

    init {
        refreshBundles()
    }

    fun refreshBundles() {
        val names = library.list().map { it.name }
        _state.update { it.copy(bundlesDir = library.root?.path, bundleNames = names) }
        if (_state.value.bundle == BundleStatus.NoneSelected && names.size == 1) openBundle(names.single())
    }

    fun openBundle(name: String) = open(name, _state.value.threads)

    fun setThreads(threads: Int) {
        when (val current = _state.value.bundle) {
            is BundleStatus.Ready -> open(current.bundle.name, threads)
            is BundleStatus.Failed -> open(current.name, threads)
            else -> _state.update { it.copy(threads = threads) }
        }
    }

    fun setPrompt(prompt: String) = _state.update { it.copy(prompt = prompt) }

    fun updateSettings(change: (GenerationSettings) -> GenerationSettings) =
        _state.update { it.copy(settings = change(it.settings)) }

    fun updateBenchForm(change: (BenchForm) -> BenchForm) =
        _state.update { it.copy(bench = it.bench.copy(form = change(it.bench.form), error = null)) }

    fun generate() {
        val current = session ?: return
        val snapshot = _state.value
        if (snapshot.busy || snapshot.prompt.isBlank()) return
        _state.update { it.copy(generation = GenerationUi(running = true)) }
        viewModelScope.launch {
            val outcome = try {
                val (stats, drain) = battery.measureBattery {
                    current.generate(snapshot.prompt, snapshot.settings.toOptions(), ::appendOutput)
                }
                GenerationUi(output = stats.text, stats = stats, battery = drain)
            } catch (e: CancellationException) {
                throw e
            } catch (e: Exception) {
                GenerationUi(output = _state.value.generation.output, error = describe(e))
            } catch (e: OutOfMemoryError) {
                GenerationUi(output = _state.value.generation.output, error = describe(e))
            }
            _state.update { it.copy(generation = outcome) }
        }
    }

    fun runBench() {
        val current = session ?: return
        val snapshot = _state.value
        if (snapshot.busy) return
        val form = snapshot.bench.form
        val request = form.toRequest(current.bundle.maxDraft).getOrElse { e ->
            _state.update { it.copy(bench = it.bench.copy(error = describe(e))) }
            return
        }
        _state.update { it.copy(bench = BenchUi(form = form, running = true)) }
        viewModelScope.launch {
            val outcome = try {
                val machine = DeviceInfo.describe(
                    getApplication<Application>(), current.threads, form.profile, RunnerFactory.libraries(current.bundle),
                )
                val json = current.bench(
                    request = request,
                    machine = machine,
                    command = form.command(current.bundle.name, current.threads, request),
                    createdUtc = Instant.now().truncatedTo(ChronoUnit.SECONDS).toString(),
                    readBattery = { battery.snapshot().toBenchReading() },
                    reportProgress = { done, planned, next ->
                        _state.update { it.copy(bench = it.bench.copy(progress = BenchProgress(done, planned, next))) }
                    },
                )
                val file = withContext(Dispatchers.IO) { BenchResults.write(getApplication<Application>(), json) }
                BenchUi(resultPath = file.path)
            } catch (e: CancellationException) {
                throw e
            } catch (e: Exception) {
                BenchUi(error = describe(e))
            } catch (e: OutOfMemoryError) {
                BenchUi(error = describe(e))
            }
            _state.update { it.copy(bench = outcome.copy(form = it.bench.form)) }
        }
    }

    /** Stops the running generation or benchmark at its next check (its results so far are kept). */
    fun stop() {
        session?.requestStop()
    }

    /** Forgets the cache, so that the next prompt is prefilled from position 0 (a cold start). */
    fun resetCache() {
        val current = session ?: return
        if (_state.value.busy) return
        viewModelScope.launch { current.resetCache() }
    }

    override fun onCleared() {
        session?.close()
    }

    private fun open(name: String, threads: Int) {
        val snapshot = _state.value
        // An open in flight is not interrupted: the engine it makes would leak.
        if (snapshot.busy || snapshot.bundle is BundleStatus.Opening) return
        session?.close()
        session = null
        _state.update { it.copy(bundle = BundleStatus.Opening(name), threads = threads, generation = GenerationUi()) }
        viewModelScope.launch {
            val status = try {
                val root = library.root ?: throw BundleException("shared storage is not available")
                val bundle = withContext(Dispatchers.IO) { BundleManifest.read(File(root, name)) }
                session = EngineSession.open(getApplication<Application>(), bundle, threads)
                BundleStatus.Ready(bundle, threads)
            } catch (e: CancellationException) {
                throw e
            } catch (e: Exception) {
                BundleStatus.Failed(name, describe(e))
            } catch (e: OutOfMemoryError) {
                BundleStatus.Failed(name, describe(e))
            }
            _state.update { ui ->
                val settings = (status as? BundleStatus.Ready)?.let { ui.settings.fittedTo(it.bundle) }
                ui.copy(bundle = status, settings = settings ?: ui.settings)
            }
        }
    }

    // Called on the engine thread with each piece of committed text.
    private fun appendOutput(piece: String) =
        _state.update { it.copy(generation = it.generation.copy(output = it.generation.output + piece)) }

    private fun describe(error: Throwable): String = error.message ?: error.javaClass.simpleName

    private companion object {
        const val DEFAULT_THREADS = 4
    }
}
