import EdgeMTPCoreML
import Foundation

/// The benchmark plan as the user edits it: lists as comma-separated numbers, as on
/// `edgemtp bench`'s command line (--pp, --tg, --mtp, --repeat).
struct BenchSettings: Sendable, Equatable {
    var promptLengths: String
    var generatedTokens: String
    var depths: String
    var repetitions: Int
    var profile = ""  // the devices/profiles name of this phone, if it has one

    /// The core's defaults (BenchPlan).
    init() {
        let defaults = EMBenchPlan()
        promptLengths = Self.text(defaults.promptLengths)
        generatedTokens = Self.text(defaults.generatedTokens)
        depths = Self.text(defaults.depths)
        repetitions = defaults.repetitions
    }

    /// The plan for a bundle: the depths it can draft (0, autoregressive, always runs).
    func plan(for bundle: BundleSummary) throws(BenchSettingsError) -> BenchPlan {
        let maxDraft = bundle.hasDrafter ? bundle.maxDraft : 0
        let depths = try Self.numbers(depths, field: "depths", minimum: 0).filter { $0 <= maxDraft }
        return BenchPlan(
            promptLengths: try Self.numbers(promptLengths, field: "prompt lengths", minimum: 1),
            generatedTokens: try Self.numbers(generatedTokens, field: "generated tokens", minimum: 1),
            depths: depths.contains(0) ? depths : [0] + depths,
            repetitions: repetitions)
    }

    private static func text(_ values: [NSNumber]) -> String {
        values.map(\.stringValue).joined(separator: ", ")
    }

    private static func numbers(_ text: String, field: String, minimum: Int) throws(BenchSettingsError) -> [Int] {
        let parts = text.split(whereSeparator: { $0 == "," || $0 == " " })
        let values = parts.compactMap { Int($0) }
        guard values.count == parts.count, values.allSatisfy({ $0 >= minimum }) else {
            throw BenchSettingsError(message: "\(field): write numbers of at least \(minimum), separated by commas")
        }
        return Array(Set(values)).sorted()
    }
}

struct BenchSettingsError: Error, LocalizedError {
    var message: String
    var errorDescription: String? { message }
}

/// A plan the engine can run.
struct BenchPlan: Sendable, Equatable {
    var promptLengths: [Int]
    var generatedTokens: [Int]
    var depths: [Int]
    var repetitions: Int

    var engineValue: EMBenchPlan {
        let plan = EMBenchPlan()
        plan.promptLengths = promptLengths.map { NSNumber(value: $0) }
        plan.generatedTokens = generatedTokens.map { NSNumber(value: $0) }
        plan.depths = depths.map { NSNumber(value: $0) }
        plan.repetitions = repetitions
        return plan
    }

    /// The result's "command": the app and its settings, as `edgemtp bench` would be called.
    func command(for bundle: BundleSummary, app: String) -> String {
        func list(_ values: [Int]) -> String { values.map(String.init).joined(separator: ",") }
        return "\(app) bench --pp \(list(promptLengths)) --tg \(list(generatedTokens)) "
            + "--mtp \(list(depths)) --repeat \(repetitions) "
            + "(\(bundle.backend)/\(bundle.delegate), \(bundle.computeUnits))"
    }
}
