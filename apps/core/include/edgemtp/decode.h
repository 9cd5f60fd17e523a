// The platform-free decode engine of the edgemtp apps: the Python runtime's decode loop
// (runtime/generate.py over runtime/backends.py's StaticBackend), in C++17 with no
// dependencies, so that the Android app (through JNI) and the iOS app (through Swift's C++
// interoperability) run one engine that replays the Python runtime's conformance vectors.
//
// What lives here: MTP accept/reject (greedy, or speculative sampling with a SamplingParams),
// the draft depth cap (budget, context end, deepest
// verify method), cache positions and what the sliding rings still hold after a rollback, the
// choice of verify/draft method (draft depth and context bucket) and its left padding, prefill
// chunking into prefill_intermediate / prefill_final calls, and stop tokens. What does not: the
// model. It sits behind `Model`, which a platform implements with ExecuTorch, ONNX Runtime or
// Core ML (gathering embedding rows, running the bundle's methods, keeping hidden states).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "edgemtp/json.h"
#include "edgemtp/sampling.h"

namespace edgemtp {

// A problem with the engine's input (a prompt, a manifest, a model's answer), in one line.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct MethodChoice {
  std::string method;  // e.g. "verify_3" or "verify_3_ctx512"
  int pad = 0;         // left pad rows the method needs beyond the real rows
};

// The static sizes every method of a bundle is built for (manifest "shapes"; export/static.py's
// StaticShapes).
struct Shapes {
  int max_context = 0;
  int max_draft = 0;
  int chunk = 0;                      // rows per prefill call
  std::vector<int> context_buckets;  // cache lengths with their own methods, ascending
  std::vector<int> depths = {};      // the manifest's verify_depths (empty: 0 and max_draft)

  // Throws Error unless the sizes are positive and each bucket lies in (max_draft, max_context).
  void validate() const;
  // Draft depths with a verify method, ascending (a round between two is left-padded).
  std::vector<int> verify_depths() const;
  // The smallest context bucket holding positions < end; nullopt: the whole cache.
  std::optional<int> bucket(int end) const;
  // The verify method for `depth` drafts whose last row is at end - 1 (nullopt: any position).
  MethodChoice verify_method(int depth, std::optional<int> end) const;
  // The draft-step method for a step at `position` (it reads positions < position).
  std::string draft_method(int position) const;
  // The prefill method (prefill_final when `final`, else prefill_intermediate) for a chunk
  // whose rows end before `end`.
  std::string prefill_method(bool final, int end) const;
};

// One attention kind's cache buffer (manifest "cache.kinds"): a slot per position for full
// attention, a ring for sliding attention, and a trash slot where pad rows are written.
struct CacheKind {
  std::string name;  // "full", "sliding"
  int slots = 0;
  int trash_slot = 0;

  // The slot a row's K/V goes to: position % slots, a pad row the trash slot.
  int slot(int position, bool pad) const { return pad ? trash_slot : position % slots; }
};

// Which positions the caches still hold after a rollback (runtime/backends.py's RingTracker).
// A ring of n slots keeps position p until p + n is written. A query at `length` needs the
// window (and the drafter one more) before it, so a truncation to `length` keeps the cache
// usable only while nothing at or past oldest-needed + n has been written; otherwise the caller
// must prefill again from position 0.
class RingTracker {
 public:
  RingTracker() = default;
  RingTracker(std::vector<int> slots, int window);
  void wrote(int end);
  bool keeps(int length) const;
  // Records a truncation to `length`; true when the cache still holds [0, length).
  bool truncated(int length);

 private:
  std::vector<int> slots_;
  int window_ = 0;
  int written_end_ = 0;  // one past the highest position written since the last reset
};

// The manifest schema version this core reads: export/bundle.py's SCHEMA_VERSION, the
// "schema_version" const of runtime/manifest.schema.json. A newer manifest may mean something
// this core would misread, so it is refused rather than guessed at.
constexpr int kManifestSchemaVersion = 1;

// The backends a bundle is exported for and the delegates of each (export/bundle.py's
// SUPPORTED), in the schema's order.
struct BackendDelegates {
  std::string backend;
  std::vector<std::string> delegates;
};
const std::vector<BackendDelegates>& supported_backends();

// What the engine reads from a bundle's manifest.json.
struct BundleConfig {
  Shapes shapes;
  std::vector<CacheKind> cache_kinds;  // sorted by name
  int sliding_window = 0;
  int vocab_size = 0;
  bool has_drafter = false;
  std::vector<int> eos_token_ids;

  // Read from a whole manifest.json only (from_decode_fields leaves them empty):
  int schema_version = 0;
  std::string backend;               // "executorch", "onnx" or "coreml": what runs `program`
  std::string delegate;              // "cpu", "metal", "npu" or "htp"
  std::string program;               // the program inside the bundle: model.pte, onnx, ...
  std::vector<std::string> methods;  // the program's methods, sorted

  // A bundle's manifest.json as `edgemtp export` writes it: refuses, with one Error line, a
  // schema version other than kManifestSchemaVersion (naming both), an unknown backend or a
  // delegate the backend lacks, missing or malformed decode fields, cache kinds that disagree
  // with the layers, the shapes or the window, and a program without a method the engine
  // would call (required_methods).
  static BundleConfig from_manifest(const json::Value& manifest);
  // As from_manifest, from the file's text (a JSON syntax error is an Error too).
  static BundleConfig from_manifest_text(std::string_view text);
  // Only the decode fields, at their manifest paths (shapes, cache.kinds.<kind>.slots and
  // .trash_slot, model.sliding_window, .vocab_size, .eos_token_ids, drafter): the "manifest"
  // object of conformance vectors. Throws Error naming the first missing or malformed field.
  static BundleConfig from_decode_fields(const json::Value& fields);

  // Every method the decoder calls for these shapes, sorted: prefill_intermediate,
  // prefill_final, verify_<depth> per verify depth and draft_step (with a drafter), each
  // also per context bucket (prefill_final_ctx512, verify_3_ctx512, draft_step_ctx512).
  std::vector<std::string> required_methods() const;
};

// One call of a row method (a prefill chunk or a verify round): `rows` real rows at positions
// start.. after `pad` left pad rows. A pad row has zero inputs and position start + rows (so
// its K/V go to the trash slot and no real row attends to it).
struct RowCall {
  std::string method;
  int start = 0;
  int rows = 0;
  int pad = 0;
  std::vector<int> ids;  // the real rows' token ids

  // Every row's position, pad rows first: what the method's `positions` input holds.
  std::vector<int> positions() const;
};

// One row of logits: a view the Model owns, valid until its next call.
struct LogitsRow {
  const float* data = nullptr;
  int size = 0;
};

// A draft step's distribution: logits over `logits.size` candidates; candidate i is token
// token_ids[i] (a clustered LM head), or token i when token_ids is null.
struct DraftLogits {
  LogitsRow logits;
  const int64_t* token_ids = nullptr;
};

// The model as a platform runs it: the bundle's methods over the shared KV cache, which the
// methods write themselves (a write at position p first forgets positions >= p, so rollback
// needs no call). The model also keeps the drafter's hidden state between calls. Target logits
// rows have the bundle's vocab_size entries; the Decoder picks the tokens.
class Model {
 public:
  virtual ~Model() = default;
  // A full prompt chunk that is not the last: writes its K/V, returns nothing.
  virtual void prefill_intermediate(const RowCall& call) = 0;
  // The prompt's last chunk (left-padded to the chunk size): writes its K/V, keeps the last
  // row's hidden state for the drafter, returns the last real row's logits.
  virtual LogitsRow prefill_final(const RowCall& call) = 0;
  // A verify round (ids: the last committed token, then the drafts): writes their K/V, keeps
  // each real row's hidden state, returns each real row's logits (pad rows skipped).
  virtual std::vector<LogitsRow> verify(const RowCall& call) = 0;
  // After a verify: the drafter starts from the hidden state of real row `row` (the row of
  // the token the round ends with).
  virtual void draft_from_verify_row(int row) = 0;
  // One draft step with `method`: the target embedding of `token` and the current drafter
  // hidden state at `position`; replaces the hidden state with the step's and returns the
  // step's logits (with a clustered head: over its candidates, with their token ids).
  virtual DraftLogits draft_step(const std::string& method, int token, int position) = 0;
};

struct Truncation {
  int length = 0;
  bool keeps = true;  // the rings still hold [0, length)
};

struct DraftCall {
  std::string method;
  int position = 0;
};

// One decode round, as the conformance vectors record it.
struct Round {
  int position = 0;     // where input_token goes: the cache length before the round
  int input_token = 0;  // the last committed token
  int depth = 0;        // drafts this round
  std::vector<DraftCall> draft_calls;
  std::vector<int> drafted;
  RowCall verify;
  std::vector<int> target_argmax;  // per real verify row (what greedy decoding commits)
  int accepted = 0;
  std::vector<int> committed;  // what the round adds to the output, cut after a stop token
  std::vector<Truncation> truncates;
  int position_after = 0;
  std::vector<std::vector<int>> slots;  // per cache kind (BundleConfig order), per verify row
  // Wall time (DecodeOptions::clock): the draft steps, model calls and token choice; and the
  // rest of the round (the verify call, acceptance). What an adaptive depth policy measures.
  double draft_seconds = 0.0;
  double verify_seconds = 0.0;
};

struct Generation {
  std::vector<RowCall> prefill_calls;
  int first_token = 0;
  std::vector<Round> rounds;
  std::vector<int> tokens;  // every committed token, the prefill's first included
  std::string stop_reason;  // "stop", "length", "context" or "interrupted"
};

// Chooses each round's draft depth, at most `limit`.
class DepthPolicy {
 public:
  virtual ~DepthPolicy() = default;
  virtual int choose(int limit) = 0;
  virtual void observe(const Round& round) { (void)round; }
};

class FixedDepth : public DepthPolicy {
 public:
  explicit FixedDepth(int depth) : depth_(depth) {}
  int choose(int limit) override { return depth_ < limit ? depth_ : limit; }

 private:
  int depth_;
};

struct DecodeOptions {
  int max_new_tokens = 0;  // committed tokens, the prefill's first included
  std::vector<int> stop_ids;
  // Temperature 0: greedy (argmax). Otherwise drafts are sampled from the drafter's
  // distribution and verified by speculative sampling; the Rng is seeded from sampling.seed at
  // each generate(), so a seed repeats a generation.
  SamplingParams sampling;
  int reused = 0;  // leading prompt tokens whose K/V the cache already holds (a chat's turns)
  // Called with the first token, then with each round's committed tokens.
  std::function<void(const std::vector<int>&)> on_tokens;
  // Asked between rounds, where the cache holds exactly the committed tokens.
  std::function<bool()> should_stop;
  // Seconds on a monotonic clock, for Round's timings; empty: std::chrono::steady_clock.
  std::function<double()> clock;
};

// One sequence over one model: prefill, then rounds of draft, verify, accept and roll back.
class Decoder {
 public:
  Decoder(BundleConfig config, Model& model);

  const BundleConfig& config() const { return config_; }

  // Generation after `prompt` (whose first options.reused tokens are in the cache).
  // `max_new_tokens` counts committed tokens only: the depth shrinks near the end of the
  // budget and of the context, so drafts never spend it.
  Generation generate(const std::vector<int>& prompt, DepthPolicy& policy,
                      const DecodeOptions& options);

  // Forget positions >= length; false when a ring no longer holds [0, length) and the next
  // generation must prefill from position 0.
  bool truncate(int length);
  void reset() { truncate(0); }

 private:
  void prefill(const std::vector<int>& ids, int start, Generation& out);
  Round decode_round(int token, int position, int depth);
  int draft_token(const DraftLogits& step, std::vector<std::vector<float>>& draft_probs);
  RowCall row_call(std::string method, const std::vector<int>& ids, int start, int pad) const;
  void check_fits(int end) const;
  void check_row(const LogitsRow& row, const std::string& what) const;
  double now() const;

  BundleConfig config_;
  Model& model_;
  RingTracker rings_;
  // Set by each generate().
  SamplingParams sampling_;
  Rng rng_{0};
  std::function<double()> clock_;
};

}  // namespace edgemtp
