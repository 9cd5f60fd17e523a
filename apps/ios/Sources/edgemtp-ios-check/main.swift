// edgemtp-ios-check: the app's Core ML runner and engine on a Mac (macOS 15+, Apple silicon for
// the npu delegate), without the app shell, signing or a phone. It opens a bundle, generates
// greedily at AR and at each draft depth, prints the figures, and fails when a depth commits
// other tokens than AR: the check that the functions really share one cache (one MLState).
//
//   swift run -c release edgemtp-ios-check BUNDLE [PROMPT]
import EdgeMTPCoreML
import Foundation

let arguments = Array(CommandLine.arguments.dropFirst())
guard let path = arguments.first else {
    FileHandle.standardError.write(Data("usage: edgemtp-ios-check BUNDLE [PROMPT]\n".utf8))
    exit(2)
}

func figures(_ stats: EMGenerateStats) -> String {
    func number(_ value: Double, _ digits: Int) -> String {
        value.formatted(.number.precision(.fractionLength(digits)))
    }
    let acceptance = stats.drafted > 0 ? "\(number(stats.acceptance * 100, 0)) % of \(stats.drafted)" : "-"
    return "prefill \(number(stats.prefillTokensPerSecond, 1)) tok/s, decode \(number(stats.decodeTokensPerSecond, 1)) tok/s, "
        + "TTFT \(number(stats.ttftSeconds * 1000, 0)) ms, acceptance \(acceptance), stop: \(stats.stopReason)"
}

do {
    let engine = try EMEngine(bundleURL: URL(filePath: path))
    let info = engine.bundleInfo
    print("\(info.name): \(info.backend)/\(info.delegate) on \(info.computeUnits), functions \(info.methods.joined(separator: ", "))")
    let depths = [0] + (info.hasDrafter ? Array(1...max(1, info.maxDraft)) : [])
    var reference: [NSNumber]?
    for depth in depths {
        let options = EMGenerateOptions()
        options.depth = depth
        options.maxNewTokens = 48
        engine.reset()
        let stats: EMGenerateStats
        if info.hasTokenizer {
            stats = try engine.generate(prompt: arguments.dropFirst().first ?? "The capital of France is",
                                        options: options, stopFlag: nil, onText: nil)
        } else {
            stats = try engine.generate(tokenIDs: (1...12).map { NSNumber(value: $0) }, options: options, stopFlag: nil)
        }
        print("depth \(depth): \(figures(stats))")
        if let reference, stats.tokens != reference {
            let at = zip(stats.tokens, reference).prefix { $0 == $1 }.count
            print("FAIL: depth \(depth) parts from AR at token \(at). Greedy MTP must commit AR's tokens: "
                + "a cache the drafter does not share does this (or, rarely, an fp16 near-tie)")
            exit(1)
        }
        reference = reference ?? stats.tokens
    }
    print("ok: every depth committed AR's tokens")
} catch {
    print("FAIL: \(error.localizedDescription)")
    exit(1)
}
