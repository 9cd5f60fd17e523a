// Adaptive draft depth: runtime/adaptive.py's AdaptiveDepth as a DepthPolicy. Each round it
// picks the depth k that maximises expected committed tokens per second, E_k / T_k:
//   E_k = 1 + sum_{j<=k} prod_{i<=j} a_i, a_i the decayed acceptance of draft i given the ones
//         before it were accepted (with a prior: draft 1's, then each draft i - 1's estimate);
//   T_k = k * (one draft step) + (the verify part of a round of k drafts),
// each cost the fastest of the last kHistory rounds (per verify method for the verify part)
// younger than kMaxAge rounds. It starts with the rounds of kWarmup (1, 0, 1, 0), then
// chooses; a depth whose verify method is not measured lately borrows the nearest one's cost.
// The costs come from Round's draft_seconds and verify_seconds.
#pragma once

#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "edgemtp/decode.h"

namespace edgemtp {

// Tokens a round commits on average given the acceptance a_1..a_k of each draft (given the
// ones before it were accepted): 1 + sum_j prod_{i<=j} a_i.
double expected_committed(const std::vector<double>& acceptance);

class AdaptiveDepth : public DepthPolicy {
 public:
  // Two rounds drafting 1 and two AR rounds, alternating, before the model decides: each shape
  // is measured twice because a method's first call can carry one-off set-up.
  static constexpr int kWarmup[] = {1, 0, 1, 0};
  static constexpr int kHistory = 7;  // recent samples whose fastest is a cost
  // Rounds after which a sample no longer counts: costs drift, and a shape left alone would
  // keep a cost from another time (runtime/adaptive.py's MAX_AGE).
  static constexpr int kMaxAge = 16;

  // `verify_shape(k)`: the name of what verifies a round of k drafts (rounds with the same name
  // cost the same), for k in 0..max_depth.
  AdaptiveDepth(int max_depth, std::function<std::string(int)> verify_shape,
                double decay = 0.98, double prior_accept = 0.5, double prior_trials = 1.0);
  // For a bundle: depths up to max_draft, the verify method Shapes::verify_method picks (with
  // no context bucket), as the Python runtime's StaticBackend.verify_shape.
  explicit AdaptiveDepth(const Shapes& shapes);

  int choose(int limit) override;
  void observe(const Round& round) override;

  // Probability that draft i (1-based) is accepted, given the drafts before it were.
  double acceptance(int i) const;
  std::vector<double> acceptances(int k) const;  // acceptance(i) for drafts 1..k
  double expected_tokens(int k) const;
  // Seconds of a round's verify part at depth k, measured lately or from the nearest shape
  // measured lately.
  std::optional<double> verify_cost(int k) const;
  // Seconds of one drafter step: measured lately, else the last samples however old.
  std::optional<double> draft_cost() const;
  // Expected committed tokens per second at depth k (nullopt until its costs are known).
  std::optional<double> rate(int k) const;

  int max_depth() const { return max_depth_; }
  int rounds() const { return rounds_; }
  // Depth -> expected tokens per second at the last choice after the warmup.
  const std::map<int, double>& last_estimate() const { return last_estimate_; }

 private:
  using Samples = std::deque<std::pair<int, double>>;  // (round observed, seconds)
  std::optional<double> cost(const Samples& samples) const;

  int max_depth_;
  std::function<std::string(int)> verify_shape_;
  double decay_;
  double prior_accept_;
  double prior_trials_;
  std::vector<double> trials_;  // index i >= 1: draft i was checked
  std::vector<double> accepts_;
  Samples draft_s_;
  std::map<std::string, Samples> verify_s_;
  int rounds_ = 0;
  std::map<int, double> last_estimate_;
};

}  // namespace edgemtp
