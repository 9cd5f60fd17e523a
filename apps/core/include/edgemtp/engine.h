// What an app drives: a bundle folder opened on a platform's method runner. The engine reads
// manifest.json, tokenizer.json and the memory-mapped tables.safetensors, gathers embedding and
// per-layer rows on the host, feeds the bundle's methods exactly as the Python runtime's
// StaticBackend does (runtime/backends.py; for ONNX bundles it also keeps the cache arrays and
// writes back the rows a method returns, as runtime/runners/onnx.py's OnnxRunner), and decodes
// with the core's Decoder (greedy or sampled, fixed or adaptive draft depth), timing every phase.
//
// The platform implements only `MethodRunner`: run one named method of the bundle's program
// (ExecuTorch Module::execute / the Java Module.execute, an ONNX Runtime session per method, a
// Core ML function prediction with the shared MLState).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "edgemtp/decode.h"
#include "edgemtp/sampling.h"
#include "edgemtp/tokenizer.h"

namespace edgemtp {

class TokenTables;

enum class DType { kFloat32, kInt64 };

// A tensor the engine hands to a runner: a view of engine-owned memory, valid during run().
struct TensorView {
  std::string name;  // the manifest's method_io name
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  const void* data = nullptr;  // row-major elements of dtype
};

// A tensor a runner returns; it owns its elements (f32 or i64, whichever dtype says).
struct Tensor {
  std::string name;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  std::vector<float> f32;
  std::vector<int64_t> i64;
};

class MethodRunner {
 public:
  virtual ~MethodRunner() = default;
  // Runs `method`. `inputs` are the manifest's method_io.<method>.inputs in order, followed
  // (for bundles whose cache lives on the host: ONNX) by its cache_inputs in order. Returns the
  // method's outputs in order, followed (host cache) by its cache_outputs in order. Throws
  // edgemtp::Error with one line on failure.
  //   ExecuTorch: the inputs and outputs are method_io's; the program keeps the cache.
  //   ONNX: each TensorView is named as the session's input (cache arrays "cache.<buffer>",
  //     owned and updated by the engine from <program>/methods.json, as OnnxRunner); return
  //     the outputs, then cache_outputs, by those names' order.
  //   Core ML: the inputs are the function's, slot positions pos_<kind> included (kInt64 here:
  //     the package takes Int32), and the outputs every output method_io lists, new_pos_<kind>
  //     included (integers as kInt64); the MLState holds the K/V (zero-filled at start).
  virtual std::vector<Tensor> run(const std::string& method, const std::vector<TensorView>& inputs) = 0;
};

struct GenerateOptions {
  int max_new_tokens = 128;  // committed tokens, the first included
  int depth = -1;            // -1: adaptive (runtime.adaptive.AdaptiveDepth); 0: AR; k: pinned
  bool chat = false;         // wrap the prompt in the tokenizer's turn markers
  SamplingParams sampling;   // temperature 0: greedy
  std::vector<int> stop_ids;  // empty: the bundle's eos ids (+ the end-of-turn marker)
  // Called with each piece of newly completed text and the ids committed with it.
  std::function<void(const std::string& text, const std::vector<int>& ids)> on_text;
  // Asked between rounds; true stops the generation ("interrupted").
  std::function<bool()> should_stop;
};

// One generation's measurements, in the terms of `edgemtp bench` (runtime/bench.py).
struct GenerateStats {
  int prompt_tokens = 0;
  int reused_tokens = 0;    // leading prompt tokens whose cache an earlier generation left
  std::vector<int> tokens;  // committed tokens, the first included
  std::string text;
  std::string stop_reason;  // "stop", "length", "context" or "interrupted"
  double ttft_s = 0;        // prompt in -> first token
  double decode_s = 0;      // first token -> last token
  std::vector<std::pair<int, int>> rounds;  // per decode round: [drafted, accepted]
  // Decode rounds only (runtime.generate's decode_seconds_by_phase): table lookups, target and
  // drafter methods, and the rest ("host": token choice, cache writes, the decoder itself).
  std::map<std::string, double> seconds_by_phase;  // "embed", "target", "drafter", "host"

  double prefill_tok_s() const;  // prompt_tokens / ttft_s
  double decode_tok_s() const;   // (tokens - 1) / decode_s; 0 with fewer than 2 tokens
  double acceptance() const;     // accepted / drafted over the rounds; 0 without drafts
};

// The bundle's manifest.json as the engine reads it, for the platform to pick and open the
// program before it builds its MethodRunner (backend, delegate, program). Throws Error.
BundleConfig read_bundle_config(const std::string& bundle_dir);

class Engine {
 public:
  // Opens `bundle_dir` (manifest.json, tokenizer.json when the bundle has one,
  // tables.safetensors). Throws Error, one line naming the file and the fix, for a missing or
  // unreadable file, a manifest the core refuses, or tables that disagree with the manifest.
  // `runner` must outlive the engine.
  Engine(const std::string& bundle_dir, MethodRunner& runner);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  const BundleConfig& config() const;
  // Throws Error when the bundle has no tokenizer.json (it then takes token ids only).
  const Tokenizer& tokenizer() const;
  bool has_tokenizer() const;
  // What a generation stops at when GenerateOptions::stop_ids is empty: the manifest's eos ids
  // and, with a tokenizer that has turn markers, the end-of-turn marker.
  std::vector<int> default_stop_ids() const;
  // The bundle's memory-mapped embedding tables (edgemtp/tables.h).
  const TokenTables& tables() const;

  // Encodes `prompt` (PromptTokenizer.encode_prompt) and generates after it. A prompt that
  // starts with the tokens already in the cache (a chat's earlier turns) reuses them: as
  // Session.generate, the longest common prefix of the cached tokens and all but the prompt's
  // last token stays, the rest is truncated (or, when a sliding ring lost it, everything is
  // prefilled again). A generation that throws leaves the cache empty.
  GenerateStats generate_text(std::string_view prompt, const GenerateOptions& options);
  // The same from token ids.
  GenerateStats generate(const std::vector<int>& prompt, const GenerateOptions& options);
  // Forget the cache (the next prompt is prefilled from position 0).
  void reset();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace edgemtp
