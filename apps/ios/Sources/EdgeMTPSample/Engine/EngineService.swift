import Dispatch
import EdgeMTPCoreML
import Foundation

/// Owns the engine. Its calls block for as long as a prefill, a generation or a benchmark
/// takes, so the actor runs on a serial queue of its own: never on the main actor, never
/// holding a thread of Swift's cooperative pool, and the engine (not thread-safe) sees one
/// caller at a time.
actor EngineService {
    private let queue = DispatchSerialQueue(label: "dev.edgemtp.sample.engine", qos: .userInitiated)
    nonisolated var unownedExecutor: UnownedSerialExecutor { queue.asUnownedSerialExecutor() }

    private var engine: EMEngine?
    private var access: SecurityScopedAccess?

    struct NoBundle: LocalizedError {
        var errorDescription: String? { "Open a bundle first." }
    }

    /// Opens a bundle folder, closing the one before. The first open of a bundle compiles its
    /// Core ML package, which can take minutes for E2B/E4B.
    func open(_ folder: URL) throws -> BundleSummary {
        close()
        let access = SecurityScopedAccess(folder)
        let engine = try EMEngine(bundleURL: folder)
        self.engine = engine
        self.access = access
        return BundleSummary(engine.bundleInfo)
    }

    func close() {
        engine = nil
        access = nil  // after the engine, which maps the bundle's files
    }

    /// Generates after `prompt`, handing each completed piece of text to `onText` as it comes.
    func generate(
        prompt: String, settings: GenerationSettings, stop: EMStopFlag,
        onText: @escaping @Sendable (String) -> Void
    ) throws -> GenerationResult {
        guard let engine else { throw NoBundle() }
        let stats = try engine.generate(prompt: prompt, options: settings.engineOptions, stopFlag: stop, onText: onText)
        return GenerationResult(stats)
    }

    /// Forgets the cache, so that the next prompt shares nothing with the last one.
    func reset() {
        engine?.reset()
    }

    /// Runs the core's benchmark and returns its result JSON, each completed run's battery
    /// object read by `recorder`.
    func bench(
        _ plan: BenchPlan, machine: MachineDescription, command: String, created: String,
        recorder: BenchConditionsRecorder, stop: EMStopFlag,
        progress: @escaping @Sendable (BenchProgress) -> Void
    ) throws -> String {
        guard let engine else { throw NoBundle() }
        return try engine.runBench(
            plan: plan.engineValue, machine: machine.engineMachine, command: command, created: created,
            batteryBefore: { recorder.reading() },
            batteryAfter: { recorder.reading() },
            progress: { done, planned, next in progress(BenchProgress(done: done, planned: planned, next: next)) },
            stopFlag: stop)
    }
}

/// Where a running benchmark is.
struct BenchProgress: Sendable, Equatable {
    var done: Int
    var planned: Int
    var next: String
}
