#include "edgemtp/sampling.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <locale>
#include <numeric>
#include <sstream>
#include <string>
#include <utility>

#include "edgemtp/decode.h"

namespace edgemtp {

namespace {

// A double as Python's repr writes it (shortest round trip; "1.0", "1e-05", "nan", "inf"), so
// that a refusal reads as the Python runtime's.
std::string python_repr(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  std::string text;
  for (int digits = 1; digits <= 17; ++digits) {
    std::ostringstream out;
    out.imbue(std::locale::classic());
    out << std::scientific;
    out.precision(digits - 1);
    out << x;
    text = out.str();
    std::istringstream back(text);
    back.imbue(std::locale::classic());
    double y = 0.0;
    back >> y;
    if (y == x) break;
  }
  // text is [-]d[.ddd]e(+|-)XX
  const bool negative = text[0] == '-';
  if (negative) text.erase(0, 1);
  const std::size_t e = text.find('e');
  const std::string mantissa = text.substr(0, 1) + (e > 1 ? text.substr(2, e - 2) : "");
  const int exponent = std::stoi(text.substr(e + 1));
  const int n = static_cast<int>(mantissa.size());
  std::string out;
  if (exponent < -4 || exponent >= 16) {
    out = mantissa.substr(0, 1) + (n > 1 ? "." + mantissa.substr(1) : "") + "e" +
          (exponent < 0 ? "-" : "+") + (std::abs(exponent) < 10 ? "0" : "") +
          std::to_string(std::abs(exponent));
  } else if (exponent < 0) {
    out = "0." + std::string(static_cast<std::size_t>(-exponent - 1), '0') + mantissa;
  } else if (n <= exponent + 1) {
    out = mantissa + std::string(static_cast<std::size_t>(exponent + 1 - n), '0') + ".0";
  } else {
    out = mantissa.substr(0, static_cast<std::size_t>(exponent + 1)) + "." +
          mantissa.substr(static_cast<std::size_t>(exponent + 1));
  }
  return (negative ? "-" : "") + out;
}

uint64_t splitmix64(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

// Softmax of `scores` (float32 in and out, as torch's; -inf gets 0). At least one is finite.
std::vector<float> softmax(const std::vector<float>& scores) {
  const float max = *std::max_element(scores.begin(), scores.end());
  std::vector<double> e(scores.size());
  double total = 0.0;
  for (std::size_t i = 0; i < scores.size(); ++i) {
    e[i] = std::exp(static_cast<double>(scores[i] - max));
    total += e[i];
  }
  std::vector<float> out(scores.size());
  for (std::size_t i = 0; i < scores.size(); ++i) out[i] = static_cast<float>(e[i] / total);
  return out;
}

// `scores` with -inf where a token's probability is below min_p times the largest; the most
// likely token (the first, on ties) always stays.
std::vector<float> drop_below_min_p(std::vector<float> scores, double min_p) {
  if (min_p == 0.0) return scores;
  const std::vector<float> probs = softmax(scores);
  const int best = argmax(probs.data(), static_cast<int>(probs.size()));
  const float threshold = static_cast<float>(min_p) * probs[static_cast<std::size_t>(best)];
  for (std::size_t i = 0; i < scores.size(); ++i) {
    if (probs[i] < threshold && static_cast<int>(i) != best) {
      scores[i] = -std::numeric_limits<float>::infinity();
    }
  }
  return scores;
}

// Top-p first orders this many most likely tokens, and more only when their mass falls short
// (runtime.sampling.TOP_P_CANDIDATES): a full sort of 262144 logits is slow on a phone.
constexpr int kTopPCandidates = 256;

// Indices into `row` of the tokens that top_k and then top_p keep.
std::vector<int> kept_by_top_k_and_top_p(const std::vector<float>& row,
                                         const SamplingParams& params) {
  const int size = static_cast<int>(row.size());
  std::vector<int> ids;
  if (params.top_k > 0) {
    std::vector<float> sorted(row);
    const int k = std::min(params.top_k, size);
    std::nth_element(sorted.begin(), sorted.begin() + (k - 1), sorted.end(),
                     std::greater<float>());
    const float kth = sorted[static_cast<std::size_t>(k - 1)];
    for (int i = 0; i < size; ++i) {
      if (row[static_cast<std::size_t>(i)] >= kth) ids.push_back(i);  // ties with the k-th stay
    }
  } else {
    ids.resize(row.size());
    std::iota(ids.begin(), ids.end(), 0);
  }
  if (params.top_p == 1.0) return ids;

  // As transformers' TopPLogitsWarper: in descending order a token stays while the mass of
  // the tokens before it is < top_p, so the most likely always stays. Equal scores are
  // ordered by token id (torch.topk leaves their order unspecified).
  std::vector<float> candidates;
  for (int i : ids) candidates.push_back(row[static_cast<std::size_t>(i)]);
  const int count = static_cast<int>(candidates.size());
  // logsumexp in torch's float32 steps (log of the float sum, then + max in float): the cut
  // compares running masses with top_p, and equal scores make exact sums like 28 / 56 = 0.5.
  const float max = *std::max_element(candidates.begin(), candidates.end());
  double total = 0.0;
  for (float c : candidates) total += static_cast<double>(std::exp(c - max));
  const float log_total = std::log(static_cast<float>(total)) + max;
  const float top_p = static_cast<float>(params.top_p);

  std::vector<int> order(candidates.size());
  std::iota(order.begin(), order.end(), 0);
  const auto more_likely = [&](int a, int b) {
    const float x = candidates[static_cast<std::size_t>(a)];
    const float y = candidates[static_cast<std::size_t>(b)];
    return x > y || (x == y && a < b);
  };
  int k = std::min(kTopPCandidates, count);
  while (true) {
    std::partial_sort(order.begin(), order.begin() + k, order.end(), more_likely);
    double before = 0.0;  // accumulated in double and compared in float32, as torch's cumsum
    int n = 0;
    while (n < k && static_cast<float>(before) < top_p) {
      const float value = candidates[static_cast<std::size_t>(order[static_cast<std::size_t>(n)])];
      before += static_cast<double>(std::exp(value - log_total));
      ++n;
    }
    n = std::max(1, n);
    if (n < k || k == count) {
      std::vector<int> kept;
      for (int i = 0; i < n; ++i) kept.push_back(ids[static_cast<std::size_t>(order[i])]);
      return kept;
    }
    k = std::min(8 * k, count);
  }
}

void check_probability_rows(const std::vector<std::vector<float>>& rows, std::size_t count,
                            std::size_t size, const std::string& name) {
  if (rows.size() != count) {
    throw Error("speculative_accept: " + name + " must have " + std::to_string(count) +
                " rows, got " + std::to_string(rows.size()));
  }
  for (const std::vector<float>& row : rows) {
    if (row.size() != size) {
      throw Error("speculative_accept: every " + name + " row must have " +
                  std::to_string(size) + " entries, one has " + std::to_string(row.size()));
    }
  }
}

}  // namespace

void SamplingParams::validate() const {
  // Written as !(valid) so that NaN is refused too.
  if (!(temperature >= 0)) {
    throw Error("temperature must be >= 0 (0 means greedy), got " + python_repr(temperature));
  }
  if (std::isinf(temperature)) {
    throw Error("temperature must be finite, got " + python_repr(temperature));
  }
  if (!(top_k >= 0)) {
    throw Error("top_k must be an integer >= 0 (0 turns it off), got " + std::to_string(top_k));
  }
  if (!(0 < top_p && top_p <= 1)) {
    throw Error("top_p must be in (0, 1] (1 turns it off), got " + python_repr(top_p));
  }
  if (!(0 <= min_p && min_p < 1)) {
    throw Error("min_p must be in [0, 1) (0 turns it off), got " + python_repr(min_p));
  }
}

Rng::Rng(uint64_t seed) {
  for (uint64_t& word : state_) word = splitmix64(seed);
}

// xoshiro256** (Blackman and Vigna).
uint64_t Rng::next_u64() {
  const uint64_t result = rotl(state_[1] * 5, 7) * 9;
  const uint64_t t = state_[1] << 17;
  state_[2] ^= state_[0];
  state_[3] ^= state_[1];
  state_[1] ^= state_[2];
  state_[0] ^= state_[3];
  state_[2] ^= t;
  state_[3] = rotl(state_[3], 45);
  return result;
}

double Rng::uniform() { return static_cast<double>(next_u64() >> 11) * (1.0 / 9007199254740992.0); }

int argmax(const float* logits, int size) {
  int best = -1;
  for (int i = 0; i < size; ++i) {
    if (!std::isnan(logits[i]) && (best < 0 || logits[i] > logits[best])) best = i;
  }
  return best < 0 ? 0 : best;
}

std::vector<float> probabilities(const float* logits, int size, const SamplingParams& params) {
  if (logits == nullptr || size < 1) throw Error("probabilities: no logits");
  std::vector<float> out(static_cast<std::size_t>(size), 0.0f);
  if (params.greedy()) {
    out[static_cast<std::size_t>(argmax(logits, size))] = 1.0f;
    return out;
  }
  const float temperature = static_cast<float>(params.temperature);
  std::vector<float> scores(static_cast<std::size_t>(size));
  bool finite = false;
  for (int i = 0; i < size; ++i) {
    if (std::isnan(logits[i])) throw Error("probabilities: the logits hold NaN");
    finite = finite || std::isfinite(logits[i]);
    scores[static_cast<std::size_t>(i)] = logits[i] / temperature;
  }
  if (!finite) throw Error("probabilities: every logit is infinite");
  if (params.top_k == 0 && params.top_p == 1.0) {
    return softmax(drop_below_min_p(std::move(scores), params.min_p));
  }
  const std::vector<int> kept = kept_by_top_k_and_top_p(scores, params);
  std::vector<float> subset;
  for (int i : kept) subset.push_back(scores[static_cast<std::size_t>(i)]);
  const std::vector<float> probs = softmax(drop_below_min_p(subset, params.min_p));
  for (std::size_t i = 0; i < kept.size(); ++i) out[static_cast<std::size_t>(kept[i])] = probs[i];
  return out;
}

int sample(const std::vector<float>& probs, Rng& rng) { return sample(probs, rng.uniform()); }

int sample(const std::vector<float>& probs, double uniform) {
  double total = 0.0;
  for (float p : probs) total += static_cast<double>(p);
  if (!(total > 0.0) || !std::isfinite(total)) {
    throw Error("sample: the probabilities must be non-negative with a positive sum");
  }
  // uniform < 1, but uniform * total can round up to the total: keep it strictly below, so
  // that a token whose running sum exceeds it always exists and has positive probability.
  const double target = std::min(uniform * total, std::nextafter(total, 0.0));
  double running = 0.0;
  for (std::size_t i = 0; i < probs.size(); ++i) {
    running += static_cast<double>(probs[i]);
    if (running > target) return static_cast<int>(i);
  }
  // Unreachable with running == total at the end; the last positive entry otherwise.
  for (std::size_t i = probs.size(); i-- > 0;) {
    if (probs[i] > 0.0f) return static_cast<int>(i);
  }
  return 0;
}

Acceptance greedy_accept(const std::vector<int>& target_argmax, const std::vector<int>& drafts) {
  const std::size_t k = drafts.size();
  if (target_argmax.size() != k + 1) {
    throw Error("greedy_accept: " + std::to_string(k) + " drafts need " + std::to_string(k + 1) +
                " target rows, got " + std::to_string(target_argmax.size()));
  }
  std::size_t n = 0;
  while (n < k && drafts[n] == target_argmax[n]) ++n;
  return {static_cast<int>(n), target_argmax[n]};
}

Acceptance speculative_accept(const std::vector<std::vector<float>>& target_probs,
                              const std::vector<std::vector<float>>& draft_probs,
                              const std::vector<int>& drafts, Rng& rng) {
  std::vector<double> uniforms(drafts.size() + 1);
  for (double& u : uniforms) u = rng.uniform();
  return speculative_accept(target_probs, draft_probs, drafts, uniforms);
}

Acceptance speculative_accept(const std::vector<std::vector<float>>& target_probs,
                              const std::vector<std::vector<float>>& draft_probs,
                              const std::vector<int>& drafts,
                              const std::vector<double>& uniforms) {
  const std::size_t k = drafts.size();
  if (target_probs.empty()) throw Error("speculative_accept: no target rows");
  const std::size_t vocab = target_probs[0].size();
  check_probability_rows(target_probs, k + 1, vocab, "target_probs");
  check_probability_rows(draft_probs, k, vocab, "draft_probs");
  if (uniforms.size() != k + 1) {
    throw Error("speculative_accept: " + std::to_string(k) + " drafts need " +
                std::to_string(k + 1) + " uniforms, got " + std::to_string(uniforms.size()));
  }
  std::vector<double> p, q;
  for (std::size_t i = 0; i < k; ++i) {
    if (drafts[i] < 0 || static_cast<std::size_t>(drafts[i]) >= vocab) {
      throw Error("speculative_accept: draft " + std::to_string(drafts[i]) +
                  " is outside the vocabulary");
    }
    const std::size_t d = static_cast<std::size_t>(drafts[i]);
    p.push_back(static_cast<double>(target_probs[i][d]));
    q.push_back(static_cast<double>(draft_probs[i][d]));
    if (!(q.back() > 0.0)) {
      throw Error("speculative_accept: a drafted token has zero draft probability");
    }
  }
  // Accept draft i with probability min(1, p / q), written without the division: always when
  // p >= q (u < 1), never when p == 0.
  std::size_t n = 0;
  while (n < k && uniforms[n] * q[n] < p[n]) ++n;
  if (n == k) return {static_cast<int>(n), sample(target_probs[k], uniforms[k])};
  // The correction comes from norm(max(0, p_n - q_n)), or from p_n when that is all zero.
  std::vector<float> residual(vocab);
  bool any = false;
  for (std::size_t v = 0; v < vocab; ++v) {
    residual[v] = std::max(0.0f, target_probs[n][v] - draft_probs[n][v]);
    any = any || residual[v] > 0.0f;
  }
  const std::vector<float>& from = any ? residual : target_probs[n];
  return {static_cast<int>(n), sample(from, uniforms[k])};
}

}  // namespace edgemtp
