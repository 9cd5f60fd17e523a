// Self-contained checks of sampling, speculative acceptance, adaptive depth and the decoder's
// sampled and timed rounds, on hand-computed cases. The comparison with the Python runtime is
// tests/test_apps_sampling.py (through sampling_cli).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <iostream>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include "check.h"
#include "edgemtp/adaptive.h"
#include "edgemtp/decode.h"
#include "edgemtp/sampling.h"

namespace {

// The message of the edgemtp::Error `body` throws ("" when it throws none).
std::string error_of(const std::function<void()>& body) {
  try {
    body();
  } catch (const edgemtp::Error& e) {
    return e.what();
  }
  return "";
}

std::vector<float> probs_of(std::vector<float> logits, const edgemtp::SamplingParams& params) {
  return edgemtp::probabilities(logits.data(), static_cast<int>(logits.size()), params);
}

edgemtp::SamplingParams sampled(double temperature, int top_k = 0, double top_p = 1.0,
                                double min_p = 0.0) {
  edgemtp::SamplingParams p;
  p.temperature = temperature;
  p.top_k = top_k;
  p.top_p = top_p;
  p.min_p = min_p;
  return p;
}

// --- sampling ----------------------------------------------------------------------------------

void test_rng() {
  edgemtp::Rng a(42), b(42), c(43);
  bool differs = false;
  for (int i = 0; i < 100; ++i) {
    uint64_t x = a.next_u64();
    CHECK_EQ(x, b.next_u64());
    differs = differs || x != c.next_u64();
  }
  CHECK(differs);
  edgemtp::Rng r(7);
  double total = 0.0;
  double low = 1.0, high = 0.0;
  for (int i = 0; i < 100000; ++i) {
    double u = r.uniform();
    total += u;
    low = std::min(low, u);
    high = std::max(high, u);
  }
  CHECK(low >= 0.0 && high < 1.0);
  CHECK_NEAR(total / 100000, 0.5, 0.005);
}

void test_argmax() {
  std::vector<float> row{1.0f, 3.0f, -2.0f, 3.0f};
  CHECK_EQ(edgemtp::argmax(row.data(), 4), 1);  // the first of equal maxima
  row[0] = std::numeric_limits<float>::quiet_NaN();
  CHECK_EQ(edgemtp::argmax(row.data(), 4), 1);
}

void test_probabilities() {
  const float inf = std::numeric_limits<float>::infinity();
  // Greedy: one-hot at the first largest logit.
  std::vector<float> greedy = probs_of({1, 3, 3, 2}, edgemtp::SamplingParams{});
  CHECK(greedy == std::vector<float>({0, 1, 0, 0}));

  std::vector<float> plain = probs_of({0, std::log(2.0f), std::log(3.0f)}, sampled(1.0));
  CHECK_NEAR(plain[0], 1.0 / 6, 1e-7);
  CHECK_NEAR(plain[1], 2.0 / 6, 1e-7);
  CHECK_NEAR(plain[2], 3.0 / 6, 1e-7);
  // Temperature 2 halves the logits: exp(0), exp(ln 4 / 2) = 2.
  std::vector<float> hot = probs_of({0, std::log(4.0f)}, sampled(2.0));
  CHECK_NEAR(hot[0], 1.0 / 3, 1e-7);
  // A masked token gets 0.
  std::vector<float> masked = probs_of({0, -inf, 0}, sampled(0.8));
  CHECK(masked[1] == 0.0f && std::fabs(masked[0] - 0.5f) < 1e-7f);

  // Top-k keeps the k highest and every token tied with the k-th.
  std::vector<float> top_k = probs_of({1, 3, 2, 2, 0}, sampled(1.0, 2));
  CHECK(top_k[0] == 0.0f && top_k[4] == 0.0f);
  double e = std::exp(1.0);
  CHECK_NEAR(top_k[1], e / (e + 2), 1e-7);
  CHECK_NEAR(top_k[2], 1 / (e + 2), 1e-7);
  CHECK_NEAR(top_k[3], 1 / (e + 2), 1e-7);
  CHECK(probs_of({1, 3, 2}, sampled(1.0, 10))[0] > 0.0f);  // k beyond the vocabulary

  // Top-p keeps tokens while the mass before them is below top_p: 0.5 and 0.3 for 0.6.
  std::vector<float> base{std::log(0.5f), std::log(0.3f), std::log(0.2f)};
  std::vector<float> top_p = probs_of(base, sampled(1.0, 0, 0.6));
  CHECK_NEAR(top_p[0], 0.625, 1e-6);
  CHECK_NEAR(top_p[1], 0.375, 1e-6);
  CHECK_EQ(top_p[2], 0.0f);
  CHECK(probs_of(base, sampled(1.0, 0, 0.4)) == std::vector<float>({1, 0, 0}));
  // Min-p drops tokens below min_p times the largest probability: 0.2 < 0.5 * 0.5.
  std::vector<float> min_p = probs_of(base, sampled(1.0, 0, 1.0, 0.5));
  CHECK_NEAR(min_p[0], 0.625, 1e-6);
  CHECK_EQ(min_p[2], 0.0f);
  // Top-k, then top-p on what top-k kept: k = 2 leaves 0.625 / 0.375, top-p 0.7 keeps both.
  std::vector<float> both = probs_of(base, sampled(1.0, 2, 0.7));
  CHECK_NEAR(both[1], 0.375, 1e-6);
  CHECK_EQ(both[2], 0.0f);

  // Past the first 256 candidates: 1000 equal logits, top-p 0.9 keeps the lowest 901 ids (each
  // float32 mass is a little under 0.001, so 900 fall short of 0.9f; the Python runtime agrees).
  std::vector<float> flat = probs_of(std::vector<float>(1000, 0.5f), sampled(1.0, 0, 0.9));
  CHECK_EQ(std::count_if(flat.begin(), flat.end(), [](float p) { return p > 0.0f; }), 901);
  CHECK(flat[900] > 0.0f && flat[901] == 0.0f);
  CHECK_NEAR(flat[0], 1.0 / 901, 1e-9);

  CHECK(error_of([&] { probs_of({0, std::nanf("")}, sampled(1.0)); }).find("NaN") !=
        std::string::npos);
  CHECK(error_of([&] { probs_of({-inf, -inf}, sampled(1.0)); }).find("infinite") !=
        std::string::npos);
}

void test_validate() {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  auto refusal = [](edgemtp::SamplingParams p) { return error_of([&] { p.validate(); }); };
  CHECK_EQ(refusal(sampled(-1.0)), "temperature must be >= 0 (0 means greedy), got -1.0");
  CHECK_EQ(refusal(sampled(nan)), "temperature must be >= 0 (0 means greedy), got nan");
  CHECK_EQ(refusal(sampled(-1e-5)), "temperature must be >= 0 (0 means greedy), got -1e-05");
  CHECK_EQ(refusal(sampled(inf)), "temperature must be finite, got inf");
  CHECK_EQ(refusal(sampled(1.0, -3)), "top_k must be an integer >= 0 (0 turns it off), got -3");
  CHECK_EQ(refusal(sampled(1.0, 0, 0.0)), "top_p must be in (0, 1] (1 turns it off), got 0.0");
  CHECK_EQ(refusal(sampled(1.0, 0, 1.5)), "top_p must be in (0, 1] (1 turns it off), got 1.5");
  CHECK_EQ(refusal(sampled(1.0, 0, 1.0, 1.0)),
           "min_p must be in [0, 1) (0 turns it off), got 1.0");
  CHECK_EQ(refusal(sampled(1.0, 0, 1.0, -0.25)),
           "min_p must be in [0, 1) (0 turns it off), got -0.25");
  CHECK_EQ(refusal(sampled(0.0)), "");
  CHECK_EQ(refusal(sampled(0.7, 40, 0.95, 0.05)), "");
}

void test_sample() {
  std::vector<float> probs{0.2f, 0.0f, 0.8f};
  CHECK_EQ(edgemtp::sample(probs, 0.0), 0);
  CHECK_EQ(edgemtp::sample(probs, 0.1), 0);
  CHECK_EQ(edgemtp::sample(probs, 0.5), 2);
  CHECK_EQ(edgemtp::sample(probs, std::nextafter(1.0, 0.0)), 2);
  std::vector<float> weights{2.0f, 0.0f, 6.0f, 0.0f};  // not normalised
  CHECK_EQ(edgemtp::sample(weights, 0.24), 0);
  CHECK_EQ(edgemtp::sample(weights, 0.26), 2);
  CHECK_EQ(edgemtp::sample(weights, std::nextafter(1.0, 0.0)), 2);  // never the trailing zero
  CHECK(!error_of([] { edgemtp::sample(std::vector<float>{0.0f, 0.0f}, 0.5); }).empty());
  // Frequencies follow the weights.
  edgemtp::Rng rng(3);
  int counts[3] = {0, 0, 0};
  for (int i = 0; i < 100000; ++i) ++counts[edgemtp::sample(probs, rng)];
  CHECK_EQ(counts[1], 0);
  CHECK_NEAR(counts[0] / 100000.0, 0.2, 0.006);
}

void test_accept() {
  using Rows = std::vector<std::vector<float>>;
  // Greedy: the agreeing prefix, then the target's token.
  CHECK_EQ(edgemtp::greedy_accept({4, 5, 6}, {4, 7}).accepted, 1);
  CHECK_EQ(edgemtp::greedy_accept({4, 5, 6}, {4, 7}).next, 5);
  CHECK_EQ(edgemtp::greedy_accept({4, 5, 6}, {4, 5}).next, 6);

  Rows target{{0.3f, 0.7f, 0.0f}, {0.1f, 0.1f, 0.8f}};
  Rows draft{{0.6f, 0.4f, 0.0f}};
  // Draft 0: p 0.3, q 0.6, accepted while u * 0.6 < 0.3.
  edgemtp::Acceptance yes = edgemtp::speculative_accept(target, draft, {0}, {0.49, 0.95});
  CHECK_EQ(yes.accepted, 1);
  CHECK_EQ(yes.next, 2);  // the bonus token from the last target row
  edgemtp::Acceptance no = edgemtp::speculative_accept(target, draft, {0}, {0.51, 0.1});
  CHECK_EQ(no.accepted, 0);
  CHECK_EQ(no.next, 1);  // residual max(0, p - q) = (0, 0.3, 0): only token 1
  // Draft 1: p 0.7 >= q 0.4, always accepted.
  CHECK_EQ(edgemtp::speculative_accept(target, draft, {1}, {0.999, 0.0}).accepted, 1);
  // A draft the target never emits is always rejected.
  Rows target0{{0.0f, 1.0f, 0.0f}, {1.0f, 0.0f, 0.0f}};
  CHECK_EQ(edgemtp::speculative_accept(target0, draft, {0}, {0.0, 0.5}).accepted, 0);
  // A residual of zeros (rows that are not distributions) falls back to the target row.
  Rows half{{0.25f, 0.25f}, {1.0f, 0.0f}};
  Rows even{{0.5f, 0.5f}};
  edgemtp::Acceptance fallback = edgemtp::speculative_accept(half, even, {0}, {0.9, 0.75});
  CHECK_EQ(fallback.accepted, 0);
  CHECK_EQ(fallback.next, 1);
  // No drafts: the token comes from the only target row.
  CHECK_EQ(edgemtp::speculative_accept({{0.0f, 1.0f}}, {}, {}, {0.3}).next, 1);

  CHECK(error_of([&] { edgemtp::speculative_accept(target, draft, {2}, {0.5, 0.5}); })
            .find("zero draft probability") != std::string::npos);
  CHECK(error_of([&] { edgemtp::speculative_accept(target, draft, {0, 1}, {0.5, 0.5, 0.5}); })
            .find("target_probs must have 3 rows") != std::string::npos);
  CHECK(error_of([&] { edgemtp::speculative_accept(target, draft, {0}, {0.5}); })
            .find("need 2 uniforms") != std::string::npos);
}

// --- adaptive depth ----------------------------------------------------------------------------

edgemtp::Round round_of(int depth, int accepted, double draft_s, double verify_s) {
  edgemtp::Round r;
  r.depth = depth;
  r.accepted = accepted;
  r.draft_seconds = draft_s;
  r.verify_seconds = verify_s;
  return r;
}

void test_adaptive() {
  CHECK_EQ(edgemtp::expected_committed({}), 1.0);
  CHECK_EQ(edgemtp::expected_committed({0.5, 0.5}), 1.75);

  auto static_shape = [](int k) { return std::string(k == 0 ? "verify_0" : "verify_4"); };
  // The warmup, then E_k / T_k: verify 10 ms at any depth, drafts 1 ms each.
  for (bool agrees : {true, false}) {
    edgemtp::AdaptiveDepth policy(4, static_shape);
    std::vector<int> chosen;
    for (int i = 0; i < 200; ++i) {
      int k = policy.choose(4);
      chosen.push_back(k);
      policy.observe(round_of(k, agrees ? k : 0, 0.001 * k, 0.010));
    }
    CHECK(std::vector<int>(chosen.begin(), chosen.begin() + 4) == std::vector<int>({1, 0, 1, 0}));
    CHECK_EQ(policy.choose(4), agrees ? 4 : 0);
    CHECK_EQ(policy.choose(2), agrees ? 2 : 0);  // the limit caps the choice
    CHECK_EQ(policy.choose(0), 0);
  }

  // Acceptance counts by position, with the prior: 0.5 of 1 trial for draft 1, draft i - 1's
  // estimate of 1 trial for a deeper one.
  edgemtp::AdaptiveDepth counts(3, [](int k) { return "rows_" + std::to_string(k + 1); }, 1.0);
  counts.observe(round_of(2, 1, 0.004, 0.012));  // draft 1 accepted, draft 2 checked
  CHECK_EQ(counts.acceptance(1), 0.75);   // (1 + 0.5) / (1 + 1)
  CHECK_EQ(counts.acceptance(2), 0.375);  // (0 + 0.75) / (1 + 1)
  CHECK_EQ(counts.acceptance(3), 0.375);  // (0 + 0.375) / (0 + 1): never checked
  // Costs: a draft step 2 ms; depth 3's verify (unmeasured) borrows the nearest, rows_3.
  CHECK_EQ(*counts.verify_cost(2), 0.012);
  CHECK_EQ(*counts.verify_cost(3), 0.012);
  CHECK_EQ(*counts.rate(0), 1.0 / 0.012);  // one token, the borrowed verify cost
  CHECK_EQ(*counts.rate(2), counts.expected_tokens(2) / (0.012 + 2 * 0.002));
  counts.observe(round_of(0, 0, 0.0, 0.008));
  CHECK_EQ(*counts.verify_cost(0), 0.008);
  CHECK_EQ(*counts.verify_cost(1), 0.008);  // rows_1 and rows_3 equally near: the cheaper
  // The fastest of the last kHistory samples.
  for (double v : {0.020, 0.011, 0.030, 0.030, 0.030, 0.030, 0.030}) {
    counts.observe(round_of(2, 0, 0.004, v));
  }
  CHECK_EQ(*counts.verify_cost(2), 0.011);  // 0.012 fell out of the history
  counts.observe(round_of(2, 0, 0.004, 0.030));
  counts.observe(round_of(2, 0, 0.004, 0.030));
  CHECK_EQ(*counts.verify_cost(2), 0.030);  // and then 0.020 and 0.011
  // A sample older than kMaxAge rounds no longer counts: rows_3, left alone, borrows rows_1's.
  for (int i = 0; i < edgemtp::AdaptiveDepth::kMaxAge; ++i) {
    counts.observe(round_of(0, 0, 0.0, 0.008));
  }
  CHECK_EQ(*counts.verify_cost(2), 0.008);
  CHECK_EQ(*counts.draft_cost(), 0.002);  // a stale draft cost still counts

  // From a bundle's shapes: the verify methods verify_0 and verify_3.
  edgemtp::AdaptiveDepth bundle(edgemtp::Shapes{512, 3, 16, {128}});
  CHECK_EQ(bundle.max_depth(), 3);
  for (int k : {1, 0, 1, 0}) bundle.observe(round_of(k, k, 0.002 * k, 0.010));
  CHECK_EQ(*bundle.verify_cost(3), 0.010);  // verify_3, measured at depth 1
}

// --- the decoder -------------------------------------------------------------------------------

// Target: a fixed distribution per input token. The drafter's agrees with it, disagrees
// entirely (greedy) or differs (sampled); each call advances a fake clock.
class FakeModel : public edgemtp::Model {
 public:
  enum class Drafter { kAgrees, kNeverAgrees, kClustered };
  static constexpr int kVocab = 11;

  FakeModel(Drafter drafter, double* clock) : drafter_(drafter), clock_(clock) {}

  static std::vector<float> target_logits(int token) {
    std::vector<float> row(kVocab);
    for (int v = 0; v < kVocab; ++v) row[v] = static_cast<float>(((token * 5 + v * 3) % 7)) * 0.4f;
    return row;
  }

  void prefill_intermediate(const edgemtp::RowCall& call) override { (void)call; }

  edgemtp::LogitsRow prefill_final(const edgemtp::RowCall& call) override {
    return row(0, call.ids.back());
  }

  std::vector<edgemtp::LogitsRow> verify(const edgemtp::RowCall& call) override {
    *clock_ += 0.010;
    std::vector<edgemtp::LogitsRow> out;
    for (int i = 0; i < call.rows; ++i) {
      out.push_back(row(static_cast<std::size_t>(i), call.ids[i]));
    }
    return out;
  }

  void draft_from_verify_row(int row) override { (void)row; }

  edgemtp::DraftLogits draft_step(const std::string& method, int token, int position) override {
    (void)method;
    (void)position;
    *clock_ += 0.001;
    draft_ = target_logits(token);
    if (drafter_ == Drafter::kNeverAgrees) {
      int best = edgemtp::argmax(draft_.data(), kVocab);
      std::fill(draft_.begin(), draft_.end(), 0.0f);
      draft_[static_cast<std::size_t>((best + 1) % kVocab)] = 5.0f;
    }
    if (drafter_ != Drafter::kClustered) return {{draft_.data(), kVocab}, nullptr};
    candidates_ = {(token + 1) % kVocab, (token + 4) % kVocab, (token + 6) % kVocab};
    draft_ = {0.5f, 1.0f, 0.0f};
    return {{draft_.data(), 3}, candidates_.data()};
  }

 private:
  edgemtp::LogitsRow row(std::size_t index, int token) {
    if (rows_.size() <= index) rows_.resize(index + 1);
    rows_[index] = target_logits(token);
    return {rows_[index].data(), kVocab};
  }

  Drafter drafter_;
  double* clock_;
  std::vector<std::vector<float>> rows_;
  std::vector<float> draft_;
  std::vector<int64_t> candidates_;
};

edgemtp::BundleConfig fake_config(int max_draft) {
  edgemtp::BundleConfig c;
  c.shapes = {256, max_draft, 8, {}};
  c.cache_kinds = {{"full", 256, 256}};
  c.sliding_window = 256;
  c.vocab_size = FakeModel::kVocab;
  c.has_drafter = true;
  return c;
}

edgemtp::Generation generate(FakeModel::Drafter drafter, edgemtp::DepthPolicy& policy,
                             edgemtp::SamplingParams sampling, int tokens = 40) {
  double clock = 100.0;
  FakeModel model(drafter, &clock);
  edgemtp::Decoder decoder(fake_config(4), model);
  edgemtp::DecodeOptions options;
  options.max_new_tokens = tokens;
  options.sampling = sampling;
  options.clock = [&clock] { return clock; };
  return decoder.generate({1, 2, 3}, policy, options);
}

void test_decoder_timing_and_adaptive() {
  edgemtp::FixedDepth three(3);
  edgemtp::Generation g = generate(FakeModel::Drafter::kNeverAgrees, three, {});
  for (const edgemtp::Round& r : g.rounds) {
    CHECK_NEAR(r.draft_seconds, 0.001 * r.depth, 1e-9);
    CHECK_NEAR(r.verify_seconds, 0.010, 1e-9);
    CHECK_EQ(r.accepted, 0);
  }
  // The adaptive policy in the decoder, on the times the rounds recorded.
  edgemtp::AdaptiveDepth never(edgemtp::Shapes{256, 4, 8, {}});
  g = generate(FakeModel::Drafter::kNeverAgrees, never, {}, 60);
  std::vector<int> depths;
  for (const edgemtp::Round& r : g.rounds) depths.push_back(r.depth);
  CHECK(std::vector<int>(depths.begin(), depths.begin() + 4) == std::vector<int>({1, 0, 1, 0}));
  // Then AR, but for a few rounds at depth 1 while the prior still favours it, and a probe at
  // depth 1 every so often as the decay lets the prior back in.
  const long after_warmup = static_cast<long>(depths.size()) - 4;
  CHECK(std::all_of(depths.begin(), depths.end(), [](int d) { return d <= 1; }));
  CHECK(5 * std::count(depths.begin() + 4, depths.end(), 1) <= after_warmup);
  for (std::size_t i = 10; i + 1 < depths.size(); ++i) CHECK(depths[i] + depths[i + 1] <= 1);

  // A drafter that always agrees: deeper as the evidence grows, then the deepest allowed.
  edgemtp::AdaptiveDepth always(edgemtp::Shapes{256, 4, 8, {}});
  g = generate(FakeModel::Drafter::kAgrees, always, {}, 200);
  for (std::size_t i = 5; i < g.rounds.size(); ++i) {
    const edgemtp::Round& r = g.rounds[i];
    const int committed_before = r.position - 3 + 1;
    CHECK_EQ(r.depth, std::min(4, 200 - committed_before - 1));
  }
  for (const edgemtp::Round& r : g.rounds) CHECK_EQ(r.accepted, r.depth);
}

void test_decoder_sampling() {
  edgemtp::SamplingParams params = sampled(0.9, 0, 0.95);
  params.seed = 5;
  // A drafter with the target's distribution is always accepted (p == q).
  edgemtp::FixedDepth three(3);
  edgemtp::Generation same = generate(FakeModel::Drafter::kAgrees, three, params);
  for (const edgemtp::Round& r : same.rounds) CHECK_EQ(r.accepted, r.depth);
  // A seed repeats a generation, on the same decoder too (each generate() seeds the Rng);
  // other seeds give others.
  CHECK(generate(FakeModel::Drafter::kAgrees, three, params).tokens == same.tokens);
  {
    double clock = 0.0;
    FakeModel model(FakeModel::Drafter::kClustered, &clock);
    edgemtp::Decoder decoder(fake_config(4), model);
    edgemtp::DecodeOptions options;
    options.max_new_tokens = 30;
    options.sampling = params;
    edgemtp::Generation first = decoder.generate({1, 2, 3}, three, options);
    decoder.reset();
    CHECK(decoder.generate({1, 2, 3}, three, options).tokens == first.tokens);
  }
  std::set<std::vector<int>> seen;
  for (uint64_t seed = 0; seed < 8; ++seed) {
    params.seed = seed;
    seen.insert(generate(FakeModel::Drafter::kAgrees, three, params).tokens);
  }
  CHECK(seen.size() > 4);
  // A clustered drafter proposes only its candidates, mapped to their token ids; some rounds
  // reject, some accept.
  params.seed = 9;
  edgemtp::Generation clustered = generate(FakeModel::Drafter::kClustered, three, params, 200);
  int accepted = 0, drafted = 0;
  std::set<int> offsets;  // sampled: every candidate gets drafted, not only the likeliest
  for (const edgemtp::Round& r : clustered.rounds) {
    int fed = r.input_token;
    for (int d : r.drafted) {
      int offset = (d - fed + FakeModel::kVocab) % FakeModel::kVocab;
      CHECK(offset == 1 || offset == 4 || offset == 6);
      offsets.insert(offset);
      fed = d;
    }
    accepted += r.accepted;
    drafted += r.depth;
    // The target_argmax record is the target's argmax whatever was sampled.
    for (std::size_t i = 0; i < r.target_argmax.size(); ++i) {
      std::vector<float> logits = FakeModel::target_logits(r.verify.ids[i]);
      CHECK_EQ(r.target_argmax[i], edgemtp::argmax(logits.data(), FakeModel::kVocab));
    }
  }
  CHECK(accepted > 0 && accepted < drafted);
  CHECK_EQ(offsets.size(), 3u);
  // Refused parameters, before any model call.
  params.top_p = 0.0;
  CHECK(error_of([&] { generate(FakeModel::Drafter::kAgrees, three, params); })
            .find("top_p must be in (0, 1]") != std::string::npos);
}

// A model answering with logits of the wrong size is refused in one line.
class ShortLogits : public FakeModel {
 public:
  using FakeModel::FakeModel;
  edgemtp::LogitsRow prefill_final(const edgemtp::RowCall& call) override {
    edgemtp::LogitsRow row = FakeModel::prefill_final(call);
    row.size -= 1;
    return row;
  }
};

void test_decoder_refusals() {
  double clock = 0.0;
  ShortLogits model(FakeModel::Drafter::kAgrees, &clock);
  edgemtp::Decoder decoder(fake_config(2), model);
  edgemtp::FixedDepth two(2);
  edgemtp::DecodeOptions options;
  options.max_new_tokens = 4;
  CHECK_EQ(error_of([&] { decoder.generate({1, 2}, two, options); }),
           "prefill_final returned 10 logits for a vocabulary of 11");
}

}  // namespace

int main() {
  test_rng();
  test_argmax();
  test_probabilities();
  test_validate();
  test_sample();
  test_accept();
  test_adaptive();
  test_decoder_timing_and_adaptive();
  test_decoder_sampling();
  test_decoder_refusals();
  return edgemtp_test::summary("sampling_test");
}
