#include "edgemtp/decode.h"

#include <algorithm>
#include <chrono>
#include <string>
#include <utility>

namespace edgemtp {

namespace {

std::string bucketed(const std::string& method, std::optional<int> bucket) {
  return bucket ? method + "_ctx" + std::to_string(*bucket) : method;
}

bool contains(const std::vector<int>& values, int x) {
  return std::find(values.begin(), values.end(), x) != values.end();
}

bool contains_name(const std::vector<std::string>& names, const std::string& name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

}  // namespace

// --- shapes ------------------------------------------------------------------------------------

void Shapes::validate() const {
  if (max_context < 2 || max_draft < 0 || chunk < 1) {
    throw Error("shapes: max_context >= 2, max_draft >= 0 and chunk >= 1 required, got " +
                std::to_string(max_context) + ", " + std::to_string(max_draft) + ", " +
                std::to_string(chunk));
  }
  for (std::size_t i = 0; i < context_buckets.size(); ++i) {
    int b = context_buckets[i];
    if (!(max_draft < b && b < max_context) || (i > 0 && context_buckets[i - 1] >= b)) {
      throw Error("shapes: context bucket " + std::to_string(b) +
                  " must be ascending and lie between the draft depth + 1 and the max context, "
                  "exclusive");
    }
  }
  if (!depths.empty() && (depths.front() != 0 || depths.back() != max_draft)) {
    throw Error("shapes: verify depths must include 0 and the draft depth " +
                std::to_string(max_draft));
  }
}

std::vector<int> Shapes::verify_depths() const {
  if (!depths.empty()) return depths;
  if (max_draft == 0) return {0};
  return {0, max_draft};  // a bundle written before the manifest listed its depths
}

std::optional<int> Shapes::bucket(int end) const {
  for (int b : context_buckets) {
    if (end <= b) return b;
  }
  return std::nullopt;
}

MethodChoice Shapes::verify_method(int depth, std::optional<int> end) const {
  for (int k : verify_depths()) {
    if (k >= depth) {
      std::optional<int> b = end ? bucket(*end) : std::nullopt;
      return {bucketed("verify_" + std::to_string(k), b), k - depth};
    }
  }
  throw Error("a round of " + std::to_string(depth) + " drafts: this bundle verifies at most " +
              std::to_string(max_draft));
}

std::string Shapes::draft_method(int position) const {
  return bucketed("draft_step", bucket(position));
}

std::string Shapes::prefill_method(bool final, int end) const {
  return bucketed(final ? "prefill_final" : "prefill_intermediate", bucket(end));
}

// --- rings -------------------------------------------------------------------------------------

RingTracker::RingTracker(std::vector<int> slots, int window)
    : slots_(std::move(slots)), window_(window) {}

void RingTracker::wrote(int end) { written_end_ = std::max(written_end_, end); }

bool RingTracker::keeps(int length) const {
  int oldest_needed = std::max(0, length - window_ - 1);
  return std::all_of(slots_.begin(), slots_.end(),
                     [&](int n) { return oldest_needed + n >= written_end_; });
}

bool RingTracker::truncated(int length) {
  bool kept = keeps(length);
  written_end_ = kept ? length : 0;
  return kept;
}

// --- manifest ----------------------------------------------------------------------------------

const std::vector<BackendDelegates>& supported_backends() {
  static const std::vector<BackendDelegates> table{
      {"executorch", {"cpu", "metal", "npu", "htp"}},
      {"coreml", {"cpu", "metal", "npu"}},
      {"onnx", {"cpu", "htp"}},
  };
  return table;
}

namespace {

std::string joined(const std::vector<std::string>& items) {
  std::string out;
  for (const std::string& item : items) out += (out.empty() ? "" : ", ") + item;
  return out;
}

std::string field(const std::string& path, const std::string& key) {
  return path.empty() ? key : path + "." + key;
}

const json::Value& member(const json::Value& object, const std::string& key,
                          const std::string& path) {
  if (!object.is_object()) {
    throw Error("manifest: " + (path.empty() ? std::string("the manifest") : path) +
                " is not an object");
  }
  const json::Value* v = object.find(key);
  if (v == nullptr) throw Error("manifest: missing " + field(path, key));
  return *v;
}

int integer(const json::Value& object, const std::string& key, const std::string& path) {
  const json::Value& v = member(object, key, path);
  try {
    return v.as_int32();
  } catch (const json::TypeError& e) {
    throw Error("manifest: " + field(path, key) + ": " + e.what());
  }
}

std::vector<int> integers(const json::Value& object, const std::string& key,
                          const std::string& path) {
  const json::Value& v = member(object, key, path);
  std::vector<int> out;
  try {
    for (const json::Value& x : v.as_array()) out.push_back(x.as_int32());
  } catch (const json::TypeError& e) {
    throw Error("manifest: " + field(path, key) + ": " + e.what());
  }
  return out;
}

const std::string& text(const json::Value& object, const std::string& key,
                        const std::string& path) {
  const json::Value& v = member(object, key, path);
  if (!v.is_string() || v.as_string().empty()) {
    throw Error("manifest: " + field(path, key) + " must be a non-empty string");
  }
  return v.as_string();
}

bool boolean(const json::Value& object, const std::string& key, const std::string& path) {
  const json::Value& v = member(object, key, path);
  if (!v.is_bool()) throw Error("manifest: " + field(path, key) + " must be true or false");
  return v.as_bool();
}

void check_schema_version(const json::Value& manifest, int version) {
  if (version == kManifestSchemaVersion) return;
  const json::Value* writer = manifest.find("edgemtp_version");
  std::string by = writer != nullptr && writer->is_string() ? writer->as_string() : "?";
  std::string theirs = "manifest: schema version " + std::to_string(version) +
                       " (written by edgemtp " + by + ")";
  std::string ours = "schema version " + std::to_string(kManifestSchemaVersion);
  if (version > kManifestSchemaVersion) {
    throw Error(theirs + " is newer than this app reads (" + ours +
                "): update the app, or export the bundle with the edgemtp this app matches");
  }
  throw Error(theirs + " is older than this app reads (" + ours +
              "): export the bundle again with a current edgemtp");
}

void check_backend(const std::string& backend, const std::string& delegate) {
  const std::vector<BackendDelegates>& table = supported_backends();
  auto found = std::find_if(table.begin(), table.end(),
                            [&](const BackendDelegates& b) { return b.backend == backend; });
  if (found == table.end()) {
    std::vector<std::string> backends;
    for (const BackendDelegates& b : table) backends.push_back(b.backend);
    throw Error("manifest: unknown backend '" + backend + "' (this app runs " +
                joined(backends) + ")");
  }
  if (!contains_name(found->delegates, delegate)) {
    throw Error("manifest: backend " + backend + " has no delegate '" + delegate + "' (it has " +
                joined(found->delegates) + ")");
  }
}

}  // namespace

BundleConfig BundleConfig::from_decode_fields(const json::Value& fields) {
  BundleConfig c;
  const json::Value& shapes = member(fields, "shapes", "");
  c.shapes.max_context = integer(shapes, "max_context", "shapes");
  c.shapes.max_draft = integer(shapes, "max_draft", "shapes");
  c.shapes.chunk = integer(shapes, "chunk", "shapes");
  c.shapes.context_buckets = integers(shapes, "context_buckets", "shapes");
  if (shapes.find("verify_depths") != nullptr) {
    c.shapes.depths = integers(shapes, "verify_depths", "shapes");
    std::sort(c.shapes.depths.begin(), c.shapes.depths.end());
    c.shapes.depths.erase(std::unique(c.shapes.depths.begin(), c.shapes.depths.end()),
                          c.shapes.depths.end());
  }
  std::sort(c.shapes.context_buckets.begin(), c.shapes.context_buckets.end());
  c.shapes.context_buckets.erase(
      std::unique(c.shapes.context_buckets.begin(), c.shapes.context_buckets.end()),
      c.shapes.context_buckets.end());
  try {
    c.shapes.validate();
  } catch (const Error& e) {
    throw Error(std::string("manifest: ") + e.what());
  }

  const json::Value& model = member(fields, "model", "");
  c.sliding_window = integer(model, "sliding_window", "model");
  c.vocab_size = integer(model, "vocab_size", "model");
  c.eos_token_ids = integers(model, "eos_token_ids", "model");
  if (c.vocab_size < 1 || c.sliding_window < 1) {
    throw Error("manifest: model.vocab_size and model.sliding_window must be >= 1");
  }
  for (int id : c.eos_token_ids) {
    if (id < 0 || id >= c.vocab_size) {
      throw Error("manifest: model.eos_token_ids: " + std::to_string(id) +
                  " is outside the vocabulary (0.." + std::to_string(c.vocab_size - 1) + ")");
    }
  }

  const json::Value& kinds = member(member(fields, "cache", ""), "kinds", "cache");
  if (!kinds.is_object() || kinds.size() == 0) {
    throw Error("manifest: cache.kinds must be an object with one entry per attention kind");
  }
  // Every kind must hold what a query at the newest position reads plus a verify round's rows
  // (runtime/kv_cache.py's ring_size): fewer slots and a verify overwrites live entries.
  const int needed = std::min(c.shapes.max_context,
                              c.sliding_window + c.shapes.max_draft + 1);
  for (const auto& [name, kind] : kinds.as_object()) {  // std::map: sorted by name
    std::string path = "cache.kinds." + name;
    CacheKind k{name, integer(kind, "slots", path), integer(kind, "trash_slot", path)};
    if (k.slots < needed || k.slots > c.shapes.max_context) {
      throw Error("manifest: " + path + ".slots is " + std::to_string(k.slots) + ", must be in " +
                  std::to_string(needed) + ".." + std::to_string(c.shapes.max_context) +
                  " (window " + std::to_string(c.sliding_window) + " + max_draft " +
                  std::to_string(c.shapes.max_draft) + " + 1, up to max_context)");
    }
    if (k.trash_slot < k.slots) {
      throw Error("manifest: " + path + ".trash_slot " + std::to_string(k.trash_slot) +
                  " is a slot positions map to (0.." + std::to_string(k.slots - 1) +
                  "): pad rows would overwrite the cache");
    }
    c.cache_kinds.push_back(k);
  }

  const json::Value& drafter = member(fields, "drafter", "");
  if (!drafter.is_null() && !drafter.is_object()) {
    throw Error("manifest: drafter must be null (no drafter) or an object");
  }
  c.has_drafter = drafter.is_object();
  return c;
}

BundleConfig BundleConfig::from_manifest(const json::Value& manifest) {
  if (!manifest.is_object()) throw Error("manifest: not a JSON object");
  const int version = integer(manifest, "schema_version", "");
  check_schema_version(manifest, version);
  const std::string backend = text(manifest, "backend", "");
  const std::string delegate = text(manifest, "delegate", "");
  check_backend(backend, delegate);

  BundleConfig c = from_decode_fields(manifest);
  c.schema_version = version;
  c.backend = backend;
  c.delegate = delegate;
  c.program = text(manifest, "program", "");

  const json::Value& methods = member(manifest, "methods", "");
  if (!methods.is_object() || methods.size() == 0) {
    throw Error("manifest: methods must be an object naming the program's methods");
  }
  for (const auto& entry : methods.as_object()) c.methods.push_back(entry.first);  // sorted

  // The cache kinds are the layers' attention kinds, each ring flagged as export flags it.
  const json::Value& layers = member(member(manifest, "model", ""), "layers", "model");
  if (!layers.is_array() || layers.size() == 0) {
    throw Error("manifest: model.layers must be a non-empty array");
  }
  for (std::size_t i = 0; i < layers.size(); ++i) {
    std::string kind = text(layers[i], "attention", "model.layers[" + std::to_string(i) + "]");
    auto found = std::find_if(c.cache_kinds.begin(), c.cache_kinds.end(),
                              [&](const CacheKind& k) { return k.name == kind; });
    if (found == c.cache_kinds.end()) {
      throw Error("manifest: model.layers[" + std::to_string(i) + "] has " + kind +
                  " attention but cache.kinds has no '" + kind + "' cache");
    }
  }
  const json::Value& kinds = manifest["cache"]["kinds"];
  for (const CacheKind& k : c.cache_kinds) {
    bool ring = boolean(kinds[k.name], "ring", "cache.kinds." + k.name);
    if (ring != (k.slots < c.shapes.max_context)) {
      throw Error("manifest: cache.kinds." + k.name + ".ring is " + (ring ? "true" : "false") +
                  " for " + std::to_string(k.slots) + " slots of a " +
                  std::to_string(c.shapes.max_context) + "-position context");
    }
  }

  for (const std::string& name : c.required_methods()) {
    if (!std::binary_search(c.methods.begin(), c.methods.end(), name)) {
      throw Error("manifest: the program has no method '" + name +
                  "', which the shapes and drafter call for (it has " + joined(c.methods) + ")");
    }
  }
  if (!c.has_drafter && std::binary_search(c.methods.begin(), c.methods.end(), "draft_step")) {
    throw Error("manifest: drafter is null but the program has a draft_step method");
  }
  return c;
}

BundleConfig BundleConfig::from_manifest_text(std::string_view text) {
  json::Value manifest;
  try {
    manifest = json::Value::parse(text);
  } catch (const json::ParseError& e) {
    throw Error(std::string("manifest: not valid JSON: ") + e.what());
  }
  return from_manifest(manifest);
}

std::vector<std::string> BundleConfig::required_methods() const {
  std::vector<std::optional<int>> buckets{std::nullopt};
  buckets.insert(buckets.end(), shapes.context_buckets.begin(), shapes.context_buckets.end());
  std::vector<std::string> out;
  for (std::optional<int> b : buckets) {
    out.push_back(bucketed("prefill_final", b));
    out.push_back(bucketed("prefill_intermediate", b));
    for (int k : shapes.verify_depths()) out.push_back(bucketed("verify_" + std::to_string(k), b));
    if (has_drafter) out.push_back(bucketed("draft_step", b));
  }
  std::sort(out.begin(), out.end());
  return out;
}

// --- rows --------------------------------------------------------------------------------------

std::vector<int> RowCall::positions() const {
  std::vector<int> out(static_cast<std::size_t>(pad), start + rows);
  for (int i = 0; i < rows; ++i) out.push_back(start + i);
  return out;
}

// --- the decoder -------------------------------------------------------------------------------

Decoder::Decoder(BundleConfig config, Model& model) : config_(std::move(config)), model_(model) {
  config_.shapes.validate();
  std::vector<int> slots;
  for (const CacheKind& k : config_.cache_kinds) slots.push_back(k.slots);
  rings_ = RingTracker(slots, config_.sliding_window);
}

bool Decoder::truncate(int length) { return rings_.truncated(length); }

void Decoder::check_fits(int end) const {
  if (end > config_.shapes.max_context) {
    throw Error("context full: " + std::to_string(end) +
                " tokens exceed the bundle's max context " +
                std::to_string(config_.shapes.max_context));
  }
}

RowCall Decoder::row_call(std::string method, const std::vector<int>& ids, int start,
                          int pad) const {
  RowCall call;
  call.method = std::move(method);
  call.start = start;
  call.rows = static_cast<int>(ids.size());
  call.pad = pad;
  call.ids = ids;
  return call;
}

double Decoder::now() const {
  if (clock_) return clock_();
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void Decoder::check_row(const LogitsRow& row, const std::string& what) const {
  if (row.data == nullptr || row.size != config_.vocab_size) {
    std::string got = row.data == nullptr ? "no" : std::to_string(row.size);
    throw Error(what + " returned " + got + " logits for a vocabulary of " +
                std::to_string(config_.vocab_size));
  }
}

void Decoder::prefill(const std::vector<int>& ids, int start, Generation& out) {
  const int chunk = config_.shapes.chunk;
  const int n = static_cast<int>(ids.size());
  check_fits(start + n);
  // Full chunks through prefill_intermediate, the rest (1..chunk rows) left-padded into
  // prefill_final, which alone produces the logits.
  const int last_start = (n - 1) / chunk * chunk;
  for (int i = 0; i < last_start; i += chunk) {
    std::vector<int> rows(ids.begin() + i, ids.begin() + i + chunk);
    out.prefill_calls.push_back(
        row_call(config_.shapes.prefill_method(false, start + i + chunk), rows, start + i, 0));
    model_.prefill_intermediate(out.prefill_calls.back());
  }
  std::vector<int> rows(ids.begin() + last_start, ids.end());
  int pad = chunk - static_cast<int>(rows.size());
  out.prefill_calls.push_back(
      row_call(config_.shapes.prefill_method(true, start + n), rows, start + last_start, pad));
  LogitsRow logits = model_.prefill_final(out.prefill_calls.back());
  check_row(logits, "prefill_final");
  out.first_token = sampling_.greedy()
                        ? argmax(logits.data, logits.size)
                        : sample(probabilities(logits.data, logits.size, sampling_), rng_);
  rings_.wrote(start + n);
}

// The drafted token of one step; when sampling, also appends the distribution it was drawn
// from over the whole vocabulary (a clustered head's is zero outside its candidates), which
// speculative acceptance needs.
int Decoder::draft_token(const DraftLogits& step, std::vector<std::vector<float>>& draft_probs) {
  const LogitsRow& logits = step.logits;
  if (logits.data == nullptr || logits.size < 1 ||
      (step.token_ids == nullptr && logits.size != config_.vocab_size)) {
    throw Error("the drafter returned " + std::to_string(logits.size) + " logits for " +
                (step.token_ids ? "its candidates" : "a vocabulary of " +
                 std::to_string(config_.vocab_size)));
  }
  const auto token_of = [&](int i) -> int {
    int64_t id = step.token_ids ? step.token_ids[i] : i;
    if (id < 0 || id >= config_.vocab_size) {
      throw Error("the drafter returned token " + std::to_string(id) +
                  ", outside the vocabulary");
    }
    return static_cast<int>(id);
  };
  if (sampling_.greedy()) return token_of(argmax(logits.data, logits.size));
  std::vector<float> local = probabilities(logits.data, logits.size, sampling_);
  std::vector<float> q(static_cast<std::size_t>(config_.vocab_size), 0.0f);
  for (int i = 0; i < logits.size; ++i) q[static_cast<std::size_t>(token_of(i))] += local[i];
  // Drawing from the candidates and mapping the draw is drawing from q, over 32-odd entries
  // instead of the vocabulary.
  int token = token_of(sample(local, rng_));
  draft_probs.push_back(std::move(q));
  return token;
}

Round Decoder::decode_round(int token, int position, int depth) {
  const Shapes& shapes = config_.shapes;
  const double started = now();
  Round r;
  r.position = position;
  r.input_token = token;
  r.depth = depth;
  std::vector<int> fed{token};
  std::vector<std::vector<float>> draft_probs;
  for (int i = 0; i < depth; ++i) {
    // Every step of a round sits at the same position: the drafter attends to the cache
    // before it, never to its own drafts.
    r.draft_calls.push_back({shapes.draft_method(position), position});
    int drafted = draft_token(model_.draft_step(r.draft_calls.back().method, fed.back(), position),
                              draft_probs);
    r.drafted.push_back(drafted);
    fed.push_back(drafted);
  }
  const double drafted_at = now();
  const int end = position + depth + 1;
  check_fits(end);
  MethodChoice choice = shapes.verify_method(depth, end);
  r.verify = row_call(choice.method, fed, position, choice.pad);
  std::vector<LogitsRow> rows = model_.verify(r.verify);
  if (static_cast<int>(rows.size()) != depth + 1) {
    throw Error(r.verify.method + " returned " + std::to_string(rows.size()) + " rows for " +
                std::to_string(depth + 1) + " real rows");
  }
  for (const LogitsRow& row : rows) {
    check_row(row, r.verify.method);
    r.target_argmax.push_back(argmax(row.data, row.size));
  }
  rings_.wrote(end);
  for (const CacheKind& kind : config_.cache_kinds) {
    std::vector<int> slots;
    std::vector<int> positions = r.verify.positions();
    for (std::size_t i = 0; i < positions.size(); ++i) {
      slots.push_back(kind.slot(positions[i], static_cast<int>(i) < r.verify.pad));
    }
    r.slots.push_back(std::move(slots));
  }
  // Greedy acceptance: the longest prefix of drafts equal to the target's own choice after
  // the tokens before them, then the target's token at the first disagreement (or after the
  // last draft): greedy MTP commits exactly what greedy AR would. Sampling: speculative
  // acceptance, which commits tokens distributed exactly as the target's.
  Acceptance accept;
  if (sampling_.greedy()) {
    accept = greedy_accept(r.target_argmax, r.drafted);
  } else {
    std::vector<std::vector<float>> target_probs;
    for (const LogitsRow& row : rows) {
      target_probs.push_back(probabilities(row.data, row.size, sampling_));
    }
    accept = speculative_accept(target_probs, draft_probs, r.drafted, rng_);
  }
  const int n = accept.accepted;
  r.accepted = n;
  r.committed.assign(r.drafted.begin(), r.drafted.begin() + n);
  r.committed.push_back(accept.next);
  // The rejected drafts' K/V stay in the cache until the next write at their positions
  // forgets them; the rings are sized so that no live entry was overwritten.
  r.truncates.push_back({position + n + 1, truncate(position + n + 1)});
  model_.draft_from_verify_row(n);
  const double finished = now();
  r.draft_seconds = drafted_at - started;
  r.verify_seconds = finished - drafted_at;
  return r;
}

Generation Decoder::generate(const std::vector<int>& prompt, DepthPolicy& policy,
                             const DecodeOptions& options) {
  const Shapes& shapes = config_.shapes;
  const int length = static_cast<int>(prompt.size());
  if (prompt.empty()) throw Error("the prompt is empty");
  for (int t : prompt) {
    if (t < 0 || t >= config_.vocab_size) {
      throw Error("prompt id " + std::to_string(t) + " is outside the vocabulary (0.." +
                  std::to_string(config_.vocab_size - 1) + ")");
    }
  }
  if (length >= shapes.max_context) {
    throw Error("the prompt has " + std::to_string(length) +
                " tokens; this model's context holds " + std::to_string(shapes.max_context));
  }
  if (options.reused < 0 || options.reused >= length) {
    throw Error("reused " + std::to_string(options.reused) + " of a " + std::to_string(length) +
                "-token prompt: one must be new");
  }
  if (options.max_new_tokens < 1) throw Error("max_new_tokens must be >= 1");
  options.sampling.validate();
  sampling_ = options.sampling;
  rng_ = Rng(options.sampling.seed);
  clock_ = options.clock;
  const auto is_stop = [&](int t) { return contains(options.stop_ids, t); };

  Generation out;
  std::vector<int> ids(prompt.begin() + options.reused, prompt.end());
  prefill(ids, options.reused, out);
  out.tokens.push_back(out.first_token);
  if (options.on_tokens) options.on_tokens(out.tokens);
  int position = length;  // where the last committed token goes: committed, not yet cached
  out.stop_reason = "length";
  while (static_cast<int>(out.tokens.size()) < options.max_new_tokens &&
         !is_stop(out.tokens.back())) {
    if (options.should_stop && options.should_stop()) {
      out.stop_reason = "interrupted";
      break;
    }
    const int room = shapes.max_context - position;  // rows the cache can still take
    if (room < 1) {
      out.stop_reason = "context";
      break;
    }
    const int budget_left = options.max_new_tokens - static_cast<int>(out.tokens.size()) - 1;
    const int limit = std::min({shapes.max_draft, budget_left, room - 1});
    const int depth = config_.has_drafter ? policy.choose(limit) : 0;
    if (depth < 0 || depth > limit) {
      throw Error("the depth policy chose " + std::to_string(depth) + " drafts, limit " +
                  std::to_string(limit));
    }
    Round r = decode_round(out.tokens.back(), position, depth);
    position += static_cast<int>(r.committed.size());
    auto stop = std::find_if(r.committed.begin(), r.committed.end(), is_stop);
    if (stop != r.committed.end()) {  // tokens after a stop were cached: forget them
      position -= static_cast<int>(r.committed.end() - stop) - 1;
      r.committed.erase(stop + 1, r.committed.end());
      r.truncates.push_back({position, truncate(position)});
    }
    r.position_after = position;
    out.tokens.insert(out.tokens.end(), r.committed.begin(), r.committed.end());
    if (options.on_tokens) options.on_tokens(r.committed);
    policy.observe(r);
    out.rounds.push_back(std::move(r));
  }
  if (is_stop(out.tokens.back())) out.stop_reason = "stop";
  return out;
}

}  // namespace edgemtp
