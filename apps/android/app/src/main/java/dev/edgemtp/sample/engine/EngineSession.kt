package dev.edgemtp.sample.engine

import android.content.Context
import dev.edgemtp.sample.bundle.BundleManifest
import dev.edgemtp.sample.runner.RunnerFactory
import kotlinx.coroutines.ExecutorCoroutineDispatcher
import kotlinx.coroutines.NonCancellable
import kotlinx.coroutines.asCoroutineDispatcher
import kotlinx.coroutines.currentCoroutineContext
import kotlinx.coroutines.job
import kotlinx.coroutines.withContext
import java.util.concurrent.Executors
import java.util.concurrent.atomic.AtomicBoolean

/**
 * An opened bundle: its native engine, driven from coroutines. Every engine call runs on one
 * dedicated thread, so calls never overlap and the runner's sessions are used from one thread
 * only. A call stops early (stop reason "interrupted") after [requestStop] or when the
 * calling coroutine is cancelled.
 */
class EngineSession private constructor(
    val bundle: BundleManifest,
    val threads: Int,
    private val engine: NativeEngine,
    private val worker: ExecutorCoroutineDispatcher,
) {
    private val stopRequested = AtomicBoolean(false)

    suspend fun generate(prompt: String, options: GenerationOptions, emitText: (String) -> Unit): GenerationStats =
        onWorker { stop ->
            engine.generate(prompt, options, object : GenerationListener {
                override fun onText(text: String, tokenIds: IntArray) = emitText(text)
                override fun shouldStop() = stop()
            })
        }

    suspend fun bench(
        request: BenchRequest,
        machine: MachineDescription,
        command: String,
        createdUtc: String,
        readBattery: () -> BatteryReading?,
        reportProgress: (done: Int, planned: Int, next: String) -> Unit,
    ): String = onWorker { stop ->
        engine.bench(bundle.dir, request, machine, command, createdUtc, object : BenchListener {
            override fun batteryReading() = readBattery()
            override fun onProgress(done: Int, planned: Int, next: String) = reportProgress(done, planned, next)
            override fun shouldStop() = stop()
        })
    }

    suspend fun resetCache() = withContext(worker) { engine.reset() }

    /** Asks the running generation or benchmark to stop at its next check. */
    fun requestStop() = stopRequested.set(true)

    /** Releases the engine and runner once the running call, if any, has returned. */
    fun close() {
        worker.executor.execute {
            engine.close()
        }
        worker.close()
    }

    private suspend fun <T> onWorker(call: (stop: () -> Boolean) -> T): T {
        val caller = currentCoroutineContext().job
        stopRequested.set(false)
        return withContext(worker) { call { stopRequested.get() || !caller.isActive } }
    }

    companion object {
        /** Opens [bundle] with its runner on [threads] threads; throws what the runner or engine refuses. */
        suspend fun open(context: Context, bundle: BundleManifest, threads: Int): EngineSession {
            val worker = Executors.newSingleThreadExecutor { task ->
                // Loading a program and parsing a large manifest can nest deeply: give the engine
                // thread more stack than a default Java thread's.
                Thread(null, task, "edgemtp-engine", ENGINE_STACK_BYTES)
            }.asCoroutineDispatcher()
            try {
                // Not cancellable: an engine opened after the caller gave up would otherwise leak.
                return withContext(worker + NonCancellable) {
                    EngineSession(bundle, threads, RunnerFactory.open(context, bundle, threads), worker)
                }
            } catch (e: Throwable) {
                worker.close()
                throw e
            }
        }

        private const val ENGINE_STACK_BYTES = 8L shl 20
    }
}
