import EdgeMTPCoreML
import Foundation
import Observation

/// The app's state and actions. The engine work itself runs on EngineService's queue; this
/// model only starts it, streams its results in, and can stop it.
@MainActor @Observable
final class SampleModel {
    // The bundle
    private(set) var library: [URL] = []
    private(set) var bundle: BundleSummary?
    private(set) var isOpening = false

    // Generation
    var prompt = "Explain speculative decoding in two sentences."
    var settings = GenerationSettings()
    private(set) var output = ""
    private(set) var result: GenerationResult?
    private(set) var isGenerating = false

    // Benchmark
    var benchSettings = BenchSettings()
    private(set) var benchProgress: BenchProgress?
    private(set) var benchResults: [URL] = []
    private(set) var isBenchmarking = false

    var failure: String?
    let conditions = DeviceConditionsMonitor()

    private let service = EngineService()
    @ObservationIgnored private var work: Task<Void, Never>?

    var isBusy: Bool { isOpening || isGenerating || isBenchmarking }

    var isShowingFailure: Bool {
        get { failure != nil }
        set { if !newValue { failure = nil } }
    }

    func refreshFiles() {
        library = BundleLibrary.bundles()
        benchResults = BenchResultFile.all()
    }

    // MARK: Bundle

    func open(_ folder: URL) {
        guard !isBusy else { return }
        isOpening = true
        Task {
            defer { isOpening = false }
            do {
                let opened = try await service.open(folder)
                bundle = opened
                output = ""
                result = nil
                let depths = DraftDepth.choices(for: opened)
                if !depths.contains(settings.depth) { settings.depth = depths.last ?? .autoregressive }
            } catch {
                bundle = nil
                failure = error.localizedDescription
            }
        }
    }

    // MARK: Generation

    func generate() {
        guard bundle?.hasTokenizer == true, !isBusy else { return }
        let (prompt, settings, service) = (self.prompt, self.settings, self.service)
        output = ""
        result = nil
        isGenerating = true
        work = Task {
            let (pieces, sink) = AsyncStream.makeStream(of: String.self)
            async let outcome = Self.generate(prompt: prompt, settings: settings, on: service, into: sink)
            for await piece in pieces {
                output += piece
            }
            switch await outcome {
            case .success(let finished): result = finished
            case .failure(let error): failure = error.localizedDescription
            }
            isGenerating = false
        }
    }

    /// Stops a generation or a benchmark at its next round.
    func stop() {
        work?.cancel()
    }

    func resetCache() {
        Task { await service.reset() }
    }

    private nonisolated static func generate(
        prompt: String, settings: GenerationSettings, on service: EngineService,
        into sink: AsyncStream<String>.Continuation
    ) async -> Result<GenerationResult, any Error> {
        defer { sink.finish() }
        let stop = EMStopFlag()
        do {
            return .success(
                try await withTaskCancellationHandler {
                    try await service.generate(prompt: prompt, settings: settings, stop: stop) { sink.yield($0) }
                } onCancel: {
                    stop.requestStop()
                })
        } catch {
            return .failure(error)
        }
    }

    // MARK: Benchmark

    func runBench() {
        guard let bundle, !isBusy else { return }
        let plan: BenchPlan
        do {
            plan = try benchSettings.plan(for: bundle)
        } catch {
            failure = error.localizedDescription
            return
        }
        let request = BenchRequest(
            plan: plan,
            machine: MachineDescription.current(profile: benchSettings.profile),
            command: plan.command(for: bundle, app: "edgemtp-ios-sample"),
            created: Date.now.formatted(.iso8601))  // UTC, seconds: bench.py's "created"
        let (service, latest) = (self.service, conditions.latest)
        isBenchmarking = true
        benchProgress = nil
        work = Task {
            let (updates, sink) = AsyncStream.makeStream(of: BenchProgress.self, bufferingPolicy: .bufferingNewest(1))
            async let outcome = Self.bench(request, on: service, conditions: latest, progress: sink)
            for await update in updates {
                benchProgress = update
            }
            switch await outcome {
            case .success: benchResults = BenchResultFile.all()
            case .failure(let error): failure = error.localizedDescription
            }
            benchProgress = nil
            isBenchmarking = false
        }
    }

    private nonisolated static func bench(
        _ request: BenchRequest, on service: EngineService, conditions: LatestDeviceConditions,
        progress sink: AsyncStream<BenchProgress>.Continuation
    ) async -> Result<URL, any Error> {
        defer { sink.finish() }
        let stop = EMStopFlag()
        do {
            let json = try await withTaskCancellationHandler {
                try await service.bench(
                    request.plan, machine: request.machine, command: request.command, created: request.created,
                    recorder: BenchConditionsRecorder(conditions: conditions), stop: stop
                ) { sink.yield($0) }
            } onCancel: {
                stop.requestStop()
            }
            return .success(try BenchResultFile.write(json))
        } catch {
            return .failure(error)
        }
    }
}

/// One benchmark's settings, fixed when it starts.
struct BenchRequest: Sendable {
    var plan: BenchPlan
    var machine: MachineDescription
    var command: String
    var created: String
}
