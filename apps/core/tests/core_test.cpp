// Unit tests of the decode core that need no vectors: the JSON reader, method choice, ring
// bookkeeping, manifest parsing, and the decode loop over a scripted model whose greedy
// continuation is known, so that MTP at every depth can be checked token-identical to AR.
#include <algorithm>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include "check.h"
#include "edgemtp/decode.h"
#include "edgemtp/json.h"

namespace {

using edgemtp::json::Value;

// True when `body` throws E whose message contains `needle`.
template <typename E>
bool throws(const std::function<void()>& body, const std::string& needle) {
  try {
    body();
  } catch (const E& e) {
    if (std::string(e.what()).find(needle) != std::string::npos) return true;
    std::cerr << "  (threw \"" << e.what() << "\", wanted \"" << needle << "\")\n";
    return false;
  }
  return false;
}

// --- JSON ------------------------------------------------------------------------------------

void test_json() {
  Value v = Value::parse(
      " {\"a\": [1, -2, 3.5, 1e2, true, false, null], \"s\": \"x\\\"\\\\\\n\\u00e9\\ud83d\\ude00\","
      " \"o\": {}, \"e\": []} ");
  CHECK_EQ(v["a"].size(), 7u);
  CHECK_EQ(v["a"][0].as_int(), 1);
  CHECK_EQ(v["a"][1].as_int32(), -2);
  CHECK_EQ(v["a"][2].as_number(), 3.5);
  CHECK(!v["a"][3].is_integer());
  CHECK_EQ(v["a"][3].as_number(), 100.0);
  CHECK(v["a"][4].as_bool() && !v["a"][5].as_bool() && v["a"][6].is_null());
  CHECK_EQ(v["s"].as_string(), std::string("x\"\\\n\xC3\xA9\xF0\x9F\x98\x80"));
  CHECK(v["o"].is_object() && v["o"].size() == 0 && v["e"].is_array());
  CHECK(v.find("missing") == nullptr);
  CHECK(throws<edgemtp::json::TypeError>([&] { (void)v["missing"]; }, "missing member"));
  CHECK(throws<edgemtp::json::TypeError>([&] { (void)v["a"][2].as_int(); }, "integer"));
  CHECK(throws<edgemtp::json::TypeError>([&] { (void)v["s"].as_array(); }, "an array"));
  CHECK(throws<edgemtp::json::TypeError>([&] { (void)v["a"][9]; }, "index 9"));
  // Round trip through dump (sorted keys, compact).
  CHECK_EQ(Value::parse(v.dump()), v);
  CHECK_EQ(Value::parse("{\"b\":1,\"a\":[2]}").dump(), std::string("{\"a\": [2], \"b\": 1}"));
  CHECK_EQ(Value::parse("9223372036854775807").as_int(), 9223372036854775807LL);

  const char* bad[][2] = {
      {"", "unexpected end"},
      {"[1,]", "unexpected character"},
      {"{\"a\":1,}", "expected a string key"},
      {"01", "unexpected text after"},
      {"1.", "digits must follow '.'"},
      {"-", "invalid number"},
      {"\"abc", "unterminated string"},
      {"\"a\tb\"", "control character"},
      {"\"\\x\"", "invalid escape"},
      {"\"\\ud800\"", "unpaired surrogate"},
      {"{\"a\":1,\"a\":2}", "duplicate key"},
      {"[1] [2]", "unexpected text after"},
      {"tru", "invalid literal"},
      {"1e999", "out of range"},
  };
  for (const auto& [text, message] : bad) {
    CHECK(throws<edgemtp::json::ParseError>([&] { Value::parse(text); }, message));
  }
  CHECK(throws<edgemtp::json::ParseError>([] { Value::parse("{\n  \"a\": x}"); },
                                          "line 2, column 8"));
  std::string deep(300, '[');
  CHECK(throws<edgemtp::json::ParseError>([&] { Value::parse(deep); }, "nesting deeper"));
}

// --- shapes and rings --------------------------------------------------------------------------

void test_shapes() {
  edgemtp::Shapes s{8192, 3, 128, {512, 2048}, {}};  // an older manifest: verify_0, verify_3
  s.validate();
  CHECK_EQ(s.verify_method(0, 1).method, std::string("verify_0_ctx512"));
  CHECK_EQ(s.verify_method(2, 512).method, std::string("verify_3_ctx512"));
  CHECK_EQ(s.verify_method(2, 512).pad, 1);
  CHECK_EQ(s.verify_method(1, 513).method, std::string("verify_3_ctx2048"));
  CHECK_EQ(s.verify_method(3, 2049).method, std::string("verify_3"));
  CHECK_EQ(s.verify_method(3, std::nullopt).method, std::string("verify_3"));
  CHECK_EQ(s.draft_method(512), std::string("draft_step_ctx512"));
  CHECK_EQ(s.draft_method(513), std::string("draft_step_ctx2048"));
  CHECK_EQ(s.draft_method(8000), std::string("draft_step"));
  CHECK_EQ(s.prefill_method(false, 512), std::string("prefill_intermediate_ctx512"));
  CHECK_EQ(s.prefill_method(true, 513), std::string("prefill_final_ctx2048"));
  CHECK_EQ(s.prefill_method(true, 2049), std::string("prefill_final"));
  CHECK(throws<edgemtp::Error>([&] { s.verify_method(4, 10); }, "at most 3"));
  edgemtp::Shapes ar{64, 0, 16, {}, {}};
  CHECK_EQ(ar.verify_method(0, 5).method, std::string("verify_0"));
  CHECK(throws<edgemtp::Error>([] { edgemtp::Shapes{64, 3, 16, {3}, {}}.validate(); }, "bucket 3"));
  CHECK(throws<edgemtp::Error>([] { edgemtp::Shapes{64, 3, 16, {64}, {}}.validate(); }, "bucket 64"));
  CHECK(throws<edgemtp::Error>([] { edgemtp::Shapes{64, 3, 0, {}, {}}.validate(); }, "chunk >= 1"));
  edgemtp::Shapes every{8192, 3, 128, {512}, {0, 1, 2, 3}};  // a verify per depth
  every.validate();
  CHECK_EQ(every.verify_method(2, 512).method, std::string("verify_2_ctx512"));
  CHECK_EQ(every.verify_method(2, 512).pad, 0);
  CHECK(throws<edgemtp::Error>([] { edgemtp::Shapes{64, 3, 16, {}, {1, 3}}.validate(); },
                               "include 0"));

  edgemtp::RowCall call{"verify_3", 40, 2, 2, {7, 8}};
  CHECK(call.positions() == std::vector<int>({42, 42, 40, 41}));
}

void test_rings() {
  // Window 16, deepest draft 4: a 21-slot ring (window + max_draft + 1) beside a full cache.
  edgemtp::RingTracker rings({256, 21}, 16);
  rings.wrote(40);
  CHECK(rings.keeps(38));      // oldest needed 21: 21 + 21 >= 40
  CHECK(!rings.keeps(20));     // oldest needed 3: position 24.. overwrote it
  CHECK(rings.truncated(38));  // a rejected draft rolled back
  rings.wrote(60);
  CHECK(!rings.truncated(20));  // a chat rolled back past the ring: prefill again
  CHECK(rings.keeps(50));       // nothing written since the reset
  edgemtp::RingTracker reset({256, 21}, 16);
  reset.wrote(80);
  CHECK(!reset.truncated(50));  // lost: the cache counts as empty, the next prefill starts at 0
  reset.wrote(10);
  CHECK(reset.keeps(5));
  edgemtp::CacheKind ring{"sliding", 21, 21};
  CHECK_EQ(ring.slot(45, false), 3);
  CHECK_EQ(ring.slot(45, true), 21);
}

// --- manifest ----------------------------------------------------------------------------------

const char* kDecodeFields = R"({
  "shapes": {"max_context": 64, "max_draft": 3, "chunk": 8, "context_buckets": []},
  "cache": {"kinds": {"sliding": {"slots": 20, "trash_slot": 20, "ring": true},
                      "full": {"slots": 64, "trash_slot": 64, "ring": false}}},
  "model": {"sliding_window": 16, "vocab_size": 97, "eos_token_ids": [1]},
  "drafter": {"num_layers": 2}
})";

// The fields of a whole manifest.json the core reads beyond the decode fields (export writes
// more: tables, tokenizer, files...; the core ignores them). One context bucket, 32.
const char* kManifest = R"({
  "schema_version": 1, "edgemtp_version": "0.1.0", "backend": "executorch", "delegate": "cpu",
  "program": "model.pte",
  "shapes": {"max_context": 64, "max_draft": 3, "chunk": 8, "context_buckets": [32]},
  "cache": {"kinds": {"sliding": {"slots": 20, "trash_slot": 20, "ring": true},
                      "full": {"slots": 64, "trash_slot": 64, "ring": false}}},
  "model": {"sliding_window": 16, "vocab_size": 97, "eos_token_ids": [1],
            "layers": [{"attention": "sliding"}, {"attention": "full"}]},
  "drafter": {"num_layers": 2},
  "methods": {"prefill_intermediate": {}, "prefill_final": {}, "verify_0": {}, "verify_3": {},
              "prefill_intermediate_ctx32": {}, "prefill_final_ctx32": {},
              "verify_0_ctx32": {}, "verify_3_ctx32": {}, "draft_step": {},
              "draft_step_ctx32": {}}
})";

// kManifest with `from` (which must occur once) replaced by `to`.
std::string edited(const std::string& from, const std::string& to) {
  std::string out = kManifest;
  std::size_t at = out.find(from);
  CHECK_MSG(at != std::string::npos && out.find(from, at + 1) == std::string::npos,
            "'" + from + "' occurs once in kManifest");
  if (at != std::string::npos) out.replace(at, from.size(), to);
  return out;
}

bool refused(const std::string& text, const std::string& needle) {
  return throws<edgemtp::Error>([&] { edgemtp::BundleConfig::from_manifest_text(text); }, needle);
}

void test_manifest() {
  edgemtp::BundleConfig c = edgemtp::BundleConfig::from_decode_fields(Value::parse(kDecodeFields));
  CHECK_EQ(c.shapes.chunk, 8);
  CHECK_EQ(c.cache_kinds.size(), 2u);
  CHECK_EQ(c.cache_kinds[0].name, std::string("full"));  // sorted by name
  CHECK_EQ(c.cache_kinds[1].slots, 20);
  CHECK(c.has_drafter);
  CHECK(c.eos_token_ids == std::vector<int>({1}));
  CHECK(c.backend.empty() && c.methods.empty());
  std::string no_chunk = kDecodeFields;
  no_chunk.replace(no_chunk.find("\"chunk\": 8, "), 12, "");
  CHECK(throws<edgemtp::Error>(
      [&] { edgemtp::BundleConfig::from_decode_fields(Value::parse(no_chunk)); },
      "missing shapes.chunk"));
  std::string bad_vocab = kDecodeFields;
  bad_vocab.replace(bad_vocab.find("97"), 2, "\"x\"");
  CHECK(throws<edgemtp::Error>(
      [&] { edgemtp::BundleConfig::from_decode_fields(Value::parse(bad_vocab)); },
      "model.vocab_size"));
  // The subset is not a manifest.json: no schema version.
  CHECK(throws<edgemtp::Error>(
      [&] { edgemtp::BundleConfig::from_manifest(Value::parse(kDecodeFields)); },
      "manifest: missing schema_version"));

  edgemtp::BundleConfig m = edgemtp::BundleConfig::from_manifest_text(kManifest);
  CHECK_EQ(m.schema_version, edgemtp::kManifestSchemaVersion);
  CHECK_EQ(m.backend, std::string("executorch"));
  CHECK_EQ(m.delegate, std::string("cpu"));
  CHECK_EQ(m.program, std::string("model.pte"));
  CHECK(m.shapes.context_buckets == std::vector<int>({32}));
  CHECK(m.methods == m.required_methods());
  CHECK_EQ(m.methods.size(), 10u);
  CHECK_EQ(m.methods.front(), std::string("draft_step"));

  CHECK(refused(edited("\"schema_version\": 1", "\"schema_version\": 2"),
                "schema version 2 (written by edgemtp 0.1.0) is newer than this app reads "
                "(schema version 1)"));
  CHECK(refused(edited("\"schema_version\": 1", "\"schema_version\": 0"), "is older"));
  CHECK(refused(edited("\"schema_version\": 1, ", ""), "manifest: missing schema_version"));
  CHECK(refused(edited("\"executorch\"", "\"tflite\""),
                "unknown backend 'tflite' (this app runs executorch, coreml, onnx)"));
  CHECK(refused(edited("\"delegate\": \"cpu\"", "\"delegate\": \"gpu\""),
                "backend executorch has no delegate 'gpu'"));
  CHECK(refused(edited("\"program\": \"model.pte\",", ""), "manifest: missing program"));
  CHECK(refused(edited("\"shapes\"", "\"sizes\""), "manifest: missing shapes"));
  CHECK(refused(edited("\"verify_3_ctx32\": {}, ", ""), "no method 'verify_3_ctx32'"));
  CHECK(refused(edited("\"prefill_final_ctx32\": {}", "\"other\": {}"),
                "no method 'prefill_final_ctx32'"));
  CHECK(refused(edited("\"draft_step\": {},", ""), "no method 'draft_step'"));
  CHECK(refused(edited("\"drafter\": {\"num_layers\": 2}", "\"drafter\": null"),
                "drafter is null but the program has a draft_step method"));
  CHECK(refused(edited("{\"attention\": \"full\"}", "{\"attention\": \"local\"}"),
                "model.layers[1] has local attention but cache.kinds has no 'local' cache"));
  CHECK(refused(edited("\"slots\": 20, \"trash_slot\": 20", "\"slots\": 19, \"trash_slot\": 19"),
                "cache.kinds.sliding.slots is 19, must be in 20..64"));
  CHECK(refused(edited("\"trash_slot\": 20", "\"trash_slot\": 3"), "pad rows would overwrite"));
  CHECK(refused(edited("\"ring\": true", "\"ring\": false"), "cache.kinds.sliding.ring is false"));
  CHECK(refused(edited("\"eos_token_ids\": [1]", "\"eos_token_ids\": [97]"),
                "97 is outside the vocabulary"));
  CHECK(refused(edited("\"context_buckets\": [32]", "\"context_buckets\": [64]"),
                "manifest: shapes: context bucket 64 must be ascending"));
  CHECK(refused(std::string(kManifest) + ",", "manifest: not valid JSON: line"));
}

// --- the decode loop ---------------------------------------------------------------------------

// Logits whose argmax is `token`: a tie with the next token (the first index wins, as numpy's
// argmax) and distinct values below, so that only first-index argmax picks `token`.
void argmax_logits(std::vector<float>& row, int vocab, int token) {
  row.assign(static_cast<std::size_t>(vocab), 0.0f);
  for (int i = 0; i < vocab; ++i) {
    row[static_cast<std::size_t>(i)] = -1.0f - 0.01f * static_cast<float>(i % 17);
  }
  row[static_cast<std::size_t>(token)] = 2.0f;
  if (token + 1 < vocab) row[static_cast<std::size_t>(token + 1)] = 2.0f;
}

// A model whose greedy continuation is a known function of (token, position), over a cache it
// checks is written contiguously; its drafter proposes that continuation but errs at some
// positions, so rounds accept none, some or all of their drafts. Every other draft step answers
// as a clustered head would: logits over a few candidates and their token ids.
class ScriptedModel : public edgemtp::Model {
 public:
  explicit ScriptedModel(int vocab) : vocab_(vocab) {}

  int next(int token, int position) const { return (token * 31 + position * 7 + 11) % vocab_; }
  // Positions where the drafter errs: 3 of every 11, irregularly spaced.
  static bool wrong(int position) { return (position * position * 3 + position) % 11 < 3; }

  std::vector<std::string> methods;  // every method called, in order
  std::vector<int> cache;            // token per cached position

  void prefill_intermediate(const edgemtp::RowCall& call) override { write(call); }

  edgemtp::LogitsRow prefill_final(const edgemtp::RowCall& call) override {
    write(call);
    return row(0, next(call.ids.back(), call.start + call.rows - 1));
  }

  std::vector<edgemtp::LogitsRow> verify(const edgemtp::RowCall& call) override {
    write(call);
    std::vector<edgemtp::LogitsRow> out;
    for (int i = 0; i < call.rows; ++i) out.push_back(row(i, next(call.ids[i], call.start + i)));
    return out;
  }

  void draft_from_verify_row(int row) override {
    (void)row;
    steps_ = 0;
  }

  edgemtp::DraftLogits draft_step(const std::string& method, int token, int position) override {
    methods.push_back(method);
    int at = position + steps_++;  // the fed token's position
    int guess = next(token, at);
    int drafted = wrong(at + 1) ? (guess + 1) % vocab_ : guess;
    if (at % 2 == 0) return {row(0, drafted), nullptr};
    // Candidates (drafted - 1, drafted, drafted + 1) with the middle one largest.
    candidate_ids_ = {(drafted + vocab_ - 1) % vocab_, drafted, (drafted + 1) % vocab_};
    candidate_logits_ = {1.0f, 3.0f, 2.5f};
    return {{candidate_logits_.data(), 3}, candidate_ids_.data()};
  }

 private:
  edgemtp::LogitsRow row(int index, int token) {
    // One buffer per row: a verify's rows are all alive until the next call.
    const auto at = static_cast<std::size_t>(index);
    if (rows_.size() <= at) rows_.resize(at + 1);
    std::vector<float>& r = rows_[at];
    argmax_logits(r, vocab_, token);
    return {r.data(), vocab_};
  }

  void write(const edgemtp::RowCall& call) {
    methods.push_back(call.method);
    // A write at p forgets positions >= p (the methods' implicit rollback); it must not skip.
    CHECK_MSG(call.start <= static_cast<int>(cache.size()), "contiguous cache write");
    cache.resize(static_cast<std::size_t>(call.start));
    cache.insert(cache.end(), call.ids.begin(), call.ids.end());
    steps_ = 0;
  }

  int vocab_;
  int steps_ = 0;
  std::vector<std::vector<float>> rows_;
  std::vector<float> candidate_logits_;
  std::vector<int64_t> candidate_ids_;
};

edgemtp::BundleConfig scripted_config(int max_context, int max_draft, int chunk,
                                      std::vector<int> buckets = {}) {
  edgemtp::BundleConfig c;
  c.shapes = {max_context, max_draft, chunk, std::move(buckets), {}};
  int ring = std::min(max_context, 16 + max_draft + 1);
  c.cache_kinds = {{"full", max_context, max_context}, {"sliding", ring, ring}};
  c.sliding_window = 16;
  c.vocab_size = 97;
  c.has_drafter = true;
  return c;
}

std::vector<int> prompt_of(int n) {
  std::vector<int> p;
  for (int i = 0; i < n; ++i) p.push_back((i * 13 + 5) % 97);
  return p;
}

edgemtp::Generation run(const edgemtp::BundleConfig& config, const std::vector<int>& prompt,
                        int depth, int budget, std::vector<int> stops = {},
                        ScriptedModel* seen = nullptr) {
  ScriptedModel model(config.vocab_size);
  edgemtp::Decoder decoder(config, model);
  edgemtp::FixedDepth policy(depth);
  edgemtp::DecodeOptions options;
  options.max_new_tokens = budget;
  options.stop_ids = std::move(stops);
  edgemtp::Generation g = decoder.generate(prompt, policy, options);
  if (seen != nullptr) *seen = model;
  return g;
}

void test_decode() {
  edgemtp::BundleConfig config = scripted_config(128, 4, 8);
  std::vector<int> prompt = prompt_of(19);  // two full chunks and 3 rows
  edgemtp::Generation ar = run(config, prompt, 0, 60);
  CHECK_EQ(ar.tokens.size(), 60u);
  CHECK_EQ(ar.stop_reason, std::string("length"));
  CHECK_EQ(ar.prefill_calls.size(), 3u);
  CHECK_EQ(ar.prefill_calls[1].method, std::string("prefill_intermediate"));
  CHECK_EQ(ar.prefill_calls[1].start, 8);
  CHECK_EQ(ar.prefill_calls[2].method, std::string("prefill_final"));
  CHECK_EQ(ar.prefill_calls[2].rows, 3);
  CHECK_EQ(ar.prefill_calls[2].pad, 5);
  for (int depth = 1; depth <= 4; ++depth) {
    edgemtp::Generation mtp = run(config, prompt, depth, 60);
    CHECK(mtp.tokens == ar.tokens);  // greedy MTP is token-identical to greedy AR
    std::vector<int> accepted;
    for (const edgemtp::Round& r : mtp.rounds) {
      accepted.push_back(r.accepted);
      CHECK(r.depth <= depth);
      CHECK_EQ(r.verify.method, std::string(r.depth == 0 ? "verify_0" : "verify_4"));
      CHECK_EQ(r.verify.pad, r.depth == 0 ? 0 : 4 - r.depth);
      CHECK_EQ(r.position_after, r.position + r.accepted + 1);
    }
    CHECK(std::count(accepted.begin(), accepted.end(), 0) > 0);
    CHECK(std::count(accepted.begin(), accepted.end(), depth) > 0);
    if (depth >= 2) CHECK(std::count(accepted.begin(), accepted.end(), 1) > 0);
    // Each round drafts min(pinned, deepest, budget left after its own token, room left - 1):
    // drafts never spend the budget.
    for (const edgemtp::Round& r : mtp.rounds) {
      int committed_before = r.position - static_cast<int>(prompt.size()) + 1;
      int limit = std::min({depth, 4, 60 - committed_before - 1, 128 - r.position - 1});
      CHECK_EQ(r.depth, limit);
    }
  }
}

void test_budget_context_and_stops() {
  edgemtp::BundleConfig config = scripted_config(64, 3, 8);
  // Context end: the room left caps the depth, and generation ends with the cache full.
  edgemtp::Generation full = run(config, prompt_of(50), 3, 100);
  CHECK_EQ(full.stop_reason, std::string("context"));
  CHECK_EQ(full.rounds.back().position_after, 64);
  CHECK_EQ(full.tokens.size(), 64u - 50u + 1u);
  for (const edgemtp::Round& r : full.rounds) CHECK(r.position + r.depth + 1 <= 64);

  // A stop token committed mid-round ends generation there and rolls the cache back to it.
  edgemtp::Generation free_run = run(config, prompt_of(10), 3, 40);
  int stop_token = -1;
  std::size_t round_index = 0;
  for (std::size_t i = 0; i < free_run.rounds.size() && stop_token < 0; ++i) {
    const edgemtp::Round& r = free_run.rounds[i];
    std::vector<int> before(free_run.tokens.begin(),
                            free_run.tokens.begin() + (r.position - 10 + 1));
    if (r.committed.size() >= 2 &&
        std::find(before.begin(), before.end(), r.committed[0]) == before.end()) {
      stop_token = r.committed[0];
      round_index = i;
    }
  }
  CHECK(stop_token >= 0);
  edgemtp::Generation stopped = run(config, prompt_of(10), 3, 40, {stop_token});
  CHECK_EQ(stopped.stop_reason, std::string("stop"));
  CHECK_EQ(stopped.tokens.back(), stop_token);
  CHECK_EQ(stopped.rounds.size(), round_index + 1);
  const edgemtp::Round& last = stopped.rounds.back();
  CHECK_EQ(last.committed.size(), 1u);
  CHECK_EQ(last.truncates.size(), 2u);
  CHECK_EQ(last.truncates.back().length, last.position + 1);

  // Bad input is refused in one line.
  CHECK(throws<edgemtp::Error>([&] { run(config, {}, 0, 4); }, "empty"));
  CHECK(throws<edgemtp::Error>([&] { run(config, {97}, 0, 4); }, "outside the vocabulary"));
  CHECK(throws<edgemtp::Error>([&] { run(config, prompt_of(64), 0, 4); }, "context holds 64"));
}

void test_context_buckets() {
  edgemtp::BundleConfig config = scripted_config(256, 2, 8, {32, 64});
  edgemtp::Generation g = run(config, prompt_of(20), 2, 60);
  auto bucket_suffix = [](int end) -> std::string {
    return end <= 32 ? "_ctx32" : end <= 64 ? "_ctx64" : "";
  };
  bool crossed = false;
  for (const edgemtp::Round& r : g.rounds) {
    int end = r.position + r.depth + 1;
    crossed = crossed || end > 64;
    CHECK_EQ(r.verify.method, (r.depth == 0 ? "verify_0" : "verify_2") + bucket_suffix(end));
    for (const edgemtp::DraftCall& d : r.draft_calls) {
      CHECK_EQ(d.method, "draft_step" + bucket_suffix(d.position));
    }
  }
  CHECK(crossed);
}

}  // namespace

int main() {
  test_json();
  test_shapes();
  test_rings();
  test_manifest();
  test_decode();
  test_budget_context_and_stops();
  test_context_buckets();
  return edgemtp_test::summary("core_test");
}
