import SwiftUI

/// One generation's speed, in `edgemtp bench`'s terms.
struct GenerationStatsSection: View {
    let result: GenerationResult

    var body: some View {
        Section {
            LabeledContent("Prefill", value: rate(result.prefillTokensPerSecond))
            LabeledContent("Decode", value: rate(result.decodeTokensPerSecond))
            LabeledContent("Time to first token", value: "\(number(result.ttftSeconds * 1000, digits: 0)) ms")
            LabeledContent("Acceptance", value: acceptance)
            LabeledContent("Tokens", value: "\(result.promptTokens) in, \(result.generatedTokens) out")
            LabeledContent("Stopped by", value: result.stopReason)
        } header: {
            Text("Speed")
        } footer: {
            Text("Decode: (tokens − 1) / (last token − first token). Acceptance is not speedup: compare decode speed with AR's.")
        }
    }

    private var acceptance: String {
        guard let rate = result.acceptance, let perRound = result.tokensPerRound else { return "no drafts" }
        return "\(number(rate * 100, digits: 0)) % of \(result.drafted) drafts, \(number(perRound, digits: 2)) tokens a round"
    }

    private func rate(_ tokensPerSecond: Double) -> String {
        "\(number(tokensPerSecond, digits: 1)) tok/s"
    }

    private func number(_ value: Double, digits: Int) -> String {
        value.formatted(.number.precision(.fractionLength(digits)))
    }
}
