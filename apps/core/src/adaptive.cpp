#include "edgemtp/adaptive.h"

#include <algorithm>
#include <cmath>
#include <utility>

namespace edgemtp {

// Every expression below is written in the Python runtime's order of operations, so that the
// same rounds give bit-identical rates and so the same choices.

double expected_committed(const std::vector<double>& acceptance) {
  double total = 1.0;
  double reach = 1.0;
  for (double a : acceptance) {
    reach *= a;
    total += reach;
  }
  return total;
}

AdaptiveDepth::AdaptiveDepth(int max_depth, std::function<std::string(int)> verify_shape,
                             double decay, double prior_accept, double prior_trials)
    : max_depth_(max_depth),
      verify_shape_(std::move(verify_shape)),
      decay_(decay),
      prior_accept_(prior_accept),
      prior_trials_(prior_trials),
      trials_(static_cast<std::size_t>(std::max(0, max_depth) + 1), 0.0),
      accepts_(static_cast<std::size_t>(std::max(0, max_depth) + 1), 0.0) {
  if (max_depth < 0) throw Error("adaptive depth: max_depth must be >= 0");
  if (!verify_shape_) throw Error("adaptive depth: no verify_shape");
}

AdaptiveDepth::AdaptiveDepth(const Shapes& shapes)
    : AdaptiveDepth(shapes.max_draft,
                    [shapes](int k) { return shapes.verify_method(k, std::nullopt).method; }) {}

double AdaptiveDepth::acceptance(int i) const { return acceptances(i).back(); }

// runtime.adaptive: draft 1 starts from the prior, draft i > 1 from draft i - 1's estimate
std::vector<double> AdaptiveDepth::acceptances(int k) const {
  std::vector<double> out;
  for (int i = 1; i <= k; ++i) {
    const auto at = static_cast<std::size_t>(i);
    const double pseudo = i == 1 ? prior_accept_ : out.back() * prior_trials_;
    out.push_back((accepts_.at(at) + pseudo) / (trials_.at(at) + prior_trials_));
  }
  return out;
}

double AdaptiveDepth::expected_tokens(int k) const { return expected_committed(acceptances(k)); }

// The fastest round among the samples younger than kMaxAge rounds: other load on the machine
// and a method's one-off set-up on its first call only ever add time.
std::optional<double> AdaptiveDepth::cost(const Samples& samples) const {
  std::optional<double> fastest;
  for (const auto& [round, seconds] : samples) {
    if (rounds_ - round < kMaxAge && (!fastest || seconds < *fastest)) fastest = seconds;
  }
  return fastest;
}

// Measured lately, else the last samples however old (a stale drafter cost must not stop the
// policy from drafting again).
std::optional<double> AdaptiveDepth::draft_cost() const {
  if (std::optional<double> fresh = cost(draft_s_)) return fresh;
  if (draft_s_.empty()) return std::nullopt;
  double fastest = draft_s_.front().second;
  for (const auto& sample : draft_s_) fastest = std::min(fastest, sample.second);
  return fastest;
}

std::optional<double> AdaptiveDepth::verify_cost(int k) const {
  // Its own shape if measured lately, else the nearest depth measured lately, the cheaper on a
  // tie in distance (Python's min over (distance, cost) pairs).
  std::optional<std::pair<int, double>> nearest;
  for (int j = 0; j <= max_depth_; ++j) {
    auto found = verify_s_.find(verify_shape_(j));
    if (found == verify_s_.end()) continue;
    std::optional<double> measured = cost(found->second);
    if (!measured) continue;
    std::pair<int, double> candidate{std::abs(j - k), *measured};
    if (!nearest || candidate < *nearest) nearest = candidate;
  }
  if (!nearest) return std::nullopt;
  return nearest->second;
}

std::optional<double> AdaptiveDepth::rate(int k) const {
  const std::optional<double> verify = verify_cost(k);
  const std::optional<double> draft = draft_cost();
  if (!verify || (k != 0 && !draft)) return std::nullopt;
  const double seconds = *verify + (k != 0 ? k * *draft : 0.0);
  if (!(seconds > 0)) return std::nullopt;
  return expected_tokens(k) / seconds;
}

int AdaptiveDepth::choose(int limit) {
  limit = std::min(limit, max_depth_);
  if (limit <= 0) return 0;
  constexpr int warmup_rounds = static_cast<int>(sizeof(kWarmup) / sizeof(kWarmup[0]));
  if (rounds_ < warmup_rounds) return std::min(kWarmup[rounds_], limit);
  last_estimate_.clear();
  for (int k = 0; k <= limit; ++k) {
    if (std::optional<double> r = rate(k)) last_estimate_[k] = *r;
  }
  if (last_estimate_.empty()) return limit;
  int best = -1;
  for (const auto& [k, r] : last_estimate_) {  // ascending: a tie goes to the shallower depth
    if (best < 0 || r > last_estimate_[best]) best = k;
  }
  return best;
}

void AdaptiveDepth::observe(const Round& round) {
  ++rounds_;
  for (double& t : trials_) t *= decay_;
  for (double& a : accepts_) a *= decay_;
  const int k = round.depth;
  const int n = round.accepted;
  if (k < 0 || k > max_depth_ || n < 0 || n > k) {
    throw Error("adaptive depth: a round of " + std::to_string(k) + " drafts accepting " +
                std::to_string(n) + " (max depth " + std::to_string(max_depth_) + ")");
  }
  for (int i = 1; i <= std::min(n + 1, k); ++i) trials_[static_cast<std::size_t>(i)] += 1;
  for (int i = 1; i <= n; ++i) accepts_[static_cast<std::size_t>(i)] += 1;
  if (k != 0) {
    draft_s_.emplace_back(rounds_, round.draft_seconds / k);
    if (static_cast<int>(draft_s_.size()) > kHistory) draft_s_.pop_front();
  }
  Samples& verify = verify_s_[verify_shape_(k)];
  verify.emplace_back(rounds_, round.verify_seconds);
  if (static_cast<int>(verify.size()) > kHistory) verify.pop_front();
}

}  // namespace edgemtp
