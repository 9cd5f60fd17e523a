// sampling_cli: the core's sampling, speculative acceptance, adaptive depth and sampled decoding
// on cases a Python test writes, for comparison with the Python runtime (tests/
// test_apps_sampling.py). Reads {"cases": [...]} on stdin, prints {"results": [...]}, one result
// per case, in order ({"error": message} when the core refuses a case).
//
// Cases, by "op":
//   rng            seed, count -> u64 (hex strings) and uniform, count of each from Rng(seed)
//   probabilities  logits (null: -inf), params -> probs
//   validate       params -> ok, or error with the refusal
//   accept         target, draft (probability rows), drafts, uniforms -> accepted, next
//   accept_counts  target, draft, trials, seed: drafts sampled from the draft rows, then
//                  speculative_accept, per trial -> first (counts of the first committed token),
//                  accepted (counts of accepted drafts)
//   adaptive       max_depth, shapes (verify shape per depth) or bundle (manifest "shapes"),
//                  decay, prior_accept, prior_trials, rounds [{limit, depth, accepted, draft_s,
//                  verify_s}] -> choices, estimates (per round: depth -> rate after choose)
//   decode         a Markov model: target[phase][token] (phase = position % phases), draft
//                  [token] and optional candidates[token] (a clustered head), prompt,
//                  max_new_tokens, depth, params, seeds [first, count] -> counts of each
//                  generation's tokens ("3,1,4": n), accepted and drafted totals
#include <cstdint>
#include <functional>
#include <iostream>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "edgemtp/adaptive.h"
#include "edgemtp/decode.h"
#include "edgemtp/json.h"
#include "edgemtp/sampling.h"

namespace {

using edgemtp::json::Array;
using edgemtp::json::Object;
using edgemtp::json::Value;

std::vector<float> floats(const Value& v) {
  std::vector<float> out;
  for (const Value& x : v.as_array()) {
    out.push_back(x.is_null() ? -std::numeric_limits<float>::infinity()
                              : static_cast<float>(x.as_number()));
  }
  return out;
}

std::vector<std::vector<float>> float_rows(const Value& v) {
  std::vector<std::vector<float>> out;
  for (const Value& row : v.as_array()) out.push_back(floats(row));
  return out;
}

std::vector<int> ints(const Value& v) {
  std::vector<int> out;
  for (const Value& x : v.as_array()) out.push_back(x.as_int32());
  return out;
}

std::vector<double> doubles(const Value& v) {
  std::vector<double> out;
  for (const Value& x : v.as_array()) out.push_back(x.as_number());
  return out;
}

Value json_floats(const std::vector<float>& values) {
  Array out;
  for (float x : values) out.emplace_back(static_cast<double>(x));
  return Value(std::move(out));
}

Value json_ints(const std::vector<int>& values) {
  Array out;
  for (int x : values) out.emplace_back(x);
  return Value(std::move(out));
}

// A number, or "nan", "inf", "-inf" (which JSON cannot write).
double number(const Value& v) {
  if (!v.is_string()) return v.as_number();
  if (v.as_string() == "nan") return std::numeric_limits<double>::quiet_NaN();
  if (v.as_string() == "inf") return std::numeric_limits<double>::infinity();
  if (v.as_string() == "-inf") return -std::numeric_limits<double>::infinity();
  throw std::runtime_error("not a number: " + v.as_string());
}

edgemtp::SamplingParams params_of(const Value& v) {
  edgemtp::SamplingParams p;
  if (const Value* x = v.find("temperature")) p.temperature = number(*x);
  if (const Value* x = v.find("top_k")) p.top_k = x->as_int32();
  if (const Value* x = v.find("top_p")) p.top_p = number(*x);
  if (const Value* x = v.find("min_p")) p.min_p = number(*x);
  if (const Value* x = v.find("seed")) p.seed = static_cast<uint64_t>(x->as_int());
  return p;
}

Value counts_json(const std::map<std::string, int>& counts) {
  Object out;
  for (const auto& [key, n] : counts) out.emplace(key, Value(n));
  return Value(std::move(out));
}

// --- cases -------------------------------------------------------------------------------------

Value rng_case(const Value& c) {
  const int count = c["count"].as_int32();
  edgemtp::Rng words(static_cast<uint64_t>(c["seed"].as_int()));
  edgemtp::Rng uniforms(static_cast<uint64_t>(c["seed"].as_int()));
  Array u64;
  Array uniform;
  for (int i = 0; i < count; ++i) {
    std::ostringstream hex;
    hex << std::hex << words.next_u64();
    u64.emplace_back(hex.str());
    uniform.emplace_back(uniforms.uniform());
  }
  return Value(Object{{"u64", Value(std::move(u64))}, {"uniform", Value(std::move(uniform))}});
}

Value probabilities_case(const Value& c) {
  std::vector<float> logits = floats(c["logits"]);
  return Value(Object{{"probs", json_floats(edgemtp::probabilities(
                                    logits.data(), static_cast<int>(logits.size()),
                                    params_of(c["params"])))}});
}

Value validate_case(const Value& c) {
  params_of(c["params"]).validate();
  return Value(Object{{"ok", Value(true)}});
}

Value accept_case(const Value& c) {
  edgemtp::Acceptance a = edgemtp::speculative_accept(
      float_rows(c["target"]), float_rows(c["draft"]), ints(c["drafts"]), doubles(c["uniforms"]));
  return Value(Object{{"accepted", Value(a.accepted)}, {"next", Value(a.next)}});
}

Value accept_counts_case(const Value& c) {
  const std::vector<std::vector<float>> target = float_rows(c["target"]);
  const std::vector<std::vector<float>> draft = float_rows(c["draft"]);
  edgemtp::Rng rng(static_cast<uint64_t>(c["seed"].as_int()));
  std::vector<int> first(target.at(0).size(), 0);
  std::vector<int> accepted(draft.size() + 1, 0);
  const int trials = c["trials"].as_int32();
  for (int t = 0; t < trials; ++t) {
    std::vector<int> drafts;
    for (const std::vector<float>& q : draft) drafts.push_back(edgemtp::sample(q, rng));
    edgemtp::Acceptance a = edgemtp::speculative_accept(target, draft, drafts, rng);
    int committed_first = a.accepted > 0 ? drafts[0] : a.next;
    ++first[static_cast<std::size_t>(committed_first)];
    ++accepted[static_cast<std::size_t>(a.accepted)];
  }
  return Value(Object{{"first", json_ints(first)}, {"accepted", json_ints(accepted)}});
}

Value adaptive_case(const Value& c) {
  std::function<std::string(int)> shape;
  std::unique_ptr<edgemtp::AdaptiveDepth> policy;
  if (const Value* bundle = c.find("bundle")) {
    edgemtp::Shapes shapes{(*bundle)["max_context"].as_int32(), (*bundle)["max_draft"].as_int32(),
                           (*bundle)["chunk"].as_int32(), ints((*bundle)["context_buckets"])};
    policy = std::make_unique<edgemtp::AdaptiveDepth>(shapes);
  } else {
    std::vector<std::string> names;
    for (const Value& name : c["shapes"].as_array()) names.push_back(name.as_string());
    policy = std::make_unique<edgemtp::AdaptiveDepth>(
        c["max_depth"].as_int32(), [names](int k) { return names.at(static_cast<std::size_t>(k)); },
        c["decay"].as_number(), c["prior_accept"].as_number(), c["prior_trials"].as_number());
  }
  Array choices;
  Array estimates;
  for (const Value& r : c["rounds"].as_array()) {
    choices.emplace_back(policy->choose(r["limit"].as_int32()));
    Object estimate;
    for (const auto& [k, rate] : policy->last_estimate()) {
      estimate.emplace(std::to_string(k), Value(rate));
    }
    estimates.emplace_back(std::move(estimate));
    edgemtp::Round round;
    round.depth = r["depth"].as_int32();
    round.accepted = r["accepted"].as_int32();
    round.draft_seconds = r["draft_s"].as_number();
    round.verify_seconds = r["verify_s"].as_number();
    policy->observe(round);
  }
  return Value(Object{{"choices", Value(std::move(choices))},
                      {"estimates", Value(std::move(estimates))}});
}

// The target's logits depend on the row's token and its position's phase, the drafter's on the
// token fed (over its candidates when it has them).
class MarkovModel : public edgemtp::Model {
 public:
  explicit MarkovModel(const Value& c) : draft_(float_rows(c["draft"])) {
    for (const Value& phase : c["target"].as_array()) target_.push_back(float_rows(phase));
    if (const Value* candidates = c.find("candidates")) {
      for (const Value& row : candidates->as_array()) {
        std::vector<int64_t> ids;
        for (const Value& id : row.as_array()) ids.push_back(id.as_int());
        candidates_.push_back(std::move(ids));
      }
    }
  }

  void prefill_intermediate(const edgemtp::RowCall& call) override { (void)call; }

  edgemtp::LogitsRow prefill_final(const edgemtp::RowCall& call) override {
    return target_row(call.ids.back(), call.start + call.rows - 1);
  }

  std::vector<edgemtp::LogitsRow> verify(const edgemtp::RowCall& call) override {
    std::vector<edgemtp::LogitsRow> out;
    for (int i = 0; i < call.rows; ++i) out.push_back(target_row(call.ids[i], call.start + i));
    return out;
  }

  void draft_from_verify_row(int row) override { (void)row; }

  edgemtp::DraftLogits draft_step(const std::string& method, int token, int position) override {
    (void)method;
    (void)position;
    const std::vector<float>& row = draft_.at(static_cast<std::size_t>(token));
    edgemtp::DraftLogits out{{row.data(), static_cast<int>(row.size())}, nullptr};
    if (!candidates_.empty()) {
      out.token_ids = candidates_.at(static_cast<std::size_t>(token)).data();
    }
    return out;
  }

 private:
  edgemtp::LogitsRow target_row(int token, int position) const {
    const auto& phase = target_[static_cast<std::size_t>(position) % target_.size()];
    const std::vector<float>& row = phase.at(static_cast<std::size_t>(token));
    return {row.data(), static_cast<int>(row.size())};
  }

  std::vector<std::vector<std::vector<float>>> target_;
  std::vector<std::vector<float>> draft_;
  std::vector<std::vector<int64_t>> candidates_;
};

Value decode_case(const Value& c) {
  MarkovModel model(c);
  edgemtp::BundleConfig config;
  const int vocab = static_cast<int>(c["target"][0].size());
  const std::vector<int> prompt = ints(c["prompt"]);
  const int max_new = c["max_new_tokens"].as_int32();
  const int depth = c["depth"].as_int32();
  const int context = static_cast<int>(prompt.size()) + max_new + depth + 1;
  config.shapes = {context, depth, 4, {}};
  config.cache_kinds = {{"full", context, context}};
  config.sliding_window = context;
  config.vocab_size = vocab;
  config.has_drafter = true;
  edgemtp::Decoder decoder(config, model);
  edgemtp::DecodeOptions options;
  options.max_new_tokens = max_new;
  options.sampling = params_of(c["params"]);
  std::map<std::string, int> counts;
  int drafted = 0;
  int accepted = 0;
  const std::vector<int> seeds = ints(c["seeds"]);
  for (int s = 0; s < seeds.at(1); ++s) {
    options.sampling.seed = static_cast<uint64_t>(seeds.at(0) + s);
    edgemtp::FixedDepth policy(depth);
    decoder.reset();
    edgemtp::Generation g = decoder.generate(prompt, policy, options);
    std::string key;
    for (int t : g.tokens) key += (key.empty() ? "" : ",") + std::to_string(t);
    ++counts[key];
    for (const edgemtp::Round& r : g.rounds) {
      drafted += r.depth;
      accepted += r.accepted;
    }
  }
  return Value(Object{{"counts", counts_json(counts)},
                      {"drafted", Value(drafted)},
                      {"accepted", Value(accepted)}});
}

Value run_case(const Value& c) {
  const std::string& op = c["op"].as_string();
  if (op == "rng") return rng_case(c);
  if (op == "probabilities") return probabilities_case(c);
  if (op == "validate") return validate_case(c);
  if (op == "accept") return accept_case(c);
  if (op == "accept_counts") return accept_counts_case(c);
  if (op == "adaptive") return adaptive_case(c);
  if (op == "decode") return decode_case(c);
  throw std::runtime_error("unknown op '" + op + "'");
}

}  // namespace

int main() {
  try {
    std::string text((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
    Value input = Value::parse(text);
    Array results;
    for (const Value& c : input["cases"].as_array()) {
      try {
        results.push_back(run_case(c));
      } catch (const edgemtp::Error& e) {
        results.emplace_back(Object{{"error", Value(std::string(e.what()))}});
      }
    }
    std::cout << Value(Object{{"results", Value(std::move(results))}}).dump() << "\n";
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "sampling_cli: " << e.what() << "\n";
    return 2;
  }
}
