// Sampling and speculative acceptance for the apps' decode core: runtime/sampling.py in C++17.
//   - `probabilities`: temperature, then top-k, top-p, min-p, with transformers' warper
//     semantics (runtime.sampling.probabilities); temperature 0 is greedy (one-hot at argmax).
//   - `greedy_accept`: runtime.sampling.greedy_accept.
//   - `speculative_accept`: runtime.sampling.speculative_accept (Leviathan et al. 2023): the
//     committed tokens are distributed exactly as the target's.
// Randomness comes from `Rng` (a seeded, platform-independent generator), so a seed gives the
// same tokens on every platform the core runs on; it is not torch's stream.
#pragma once

#include <cstdint>
#include <vector>

namespace edgemtp {

struct SamplingParams {
  double temperature = 0.0;  // 0: greedy
  int top_k = 0;             // 0: off
  double top_p = 1.0;        // 1: off
  double min_p = 0.0;        // 0: off
  uint64_t seed = 0;
  bool greedy() const { return temperature == 0.0; }
  // Throws edgemtp::Error naming the bad value and its valid range (as SamplingParams.validate).
  void validate() const;
};

// A small, fast, seeded generator with the same stream on every platform.
class Rng {
 public:
  explicit Rng(uint64_t seed);
  uint64_t next_u64();
  double uniform();  // in [0, 1)

 private:
  uint64_t state_[4];
};

// First index of the largest value (numpy's argmax; NaN never wins).
int argmax(const float* logits, int size);

// The distribution to sample from, over `size` logits (float32, as the Python runtime).
// Where top-p's cut falls inside a group of equal scores, the lowest ids of the group stay
// (the Python runtime keeps whichever torch.topk lists first, an unspecified order). Throws
// Error on NaN logits or when none is finite.
std::vector<float> probabilities(const float* logits, int size, const SamplingParams& params);

// A token drawn from `probs` (weights need not sum to 1) with one uniform from `rng`.
int sample(const std::vector<float>& probs, Rng& rng);
// The same with the uniform given (in [0, 1)): inverse CDF, the first token whose running sum
// exceeds uniform * total; a zero-probability token is never drawn.
int sample(const std::vector<float>& probs, double uniform);

struct Acceptance {
  int accepted = 0;  // drafts accepted
  int next = 0;      // the token after them (a correction or the bonus)
};

// Greedy verification: target_argmax[i] for row i (k + 1 rows), k drafts.
Acceptance greedy_accept(const std::vector<int>& target_argmax, const std::vector<int>& drafts);

// Speculative sampling over k drafts: target_probs k + 1 rows, draft_probs k rows (each the
// exact distribution its draft was sampled from; zero outside a clustered head's candidates).
Acceptance speculative_accept(const std::vector<std::vector<float>>& target_probs,
                              const std::vector<std::vector<float>>& draft_probs,
                              const std::vector<int>& drafts, Rng& rng);
// The same with its k + 1 uniforms given: draft i is accepted while uniforms[i] * q < p, and
// the next token is sample(..., uniforms[k]). The Rng version draws them in this order.
Acceptance speculative_accept(const std::vector<std::vector<float>>& target_probs,
                              const std::vector<std::vector<float>>& draft_probs,
                              const std::vector<int>& drafts,
                              const std::vector<double>& uniforms);

}  // namespace edgemtp
