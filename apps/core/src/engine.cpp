#include "edgemtp/engine.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>
#include <utility>

#include "edgemtp/adaptive.h"
#include "edgemtp/json.h"
#include "edgemtp/tables.h"

namespace edgemtp {

// --- stats -------------------------------------------------------------------------------------

double GenerateStats::prefill_tok_s() const {
  return ttft_s > 0 ? prompt_tokens / ttft_s : 0.0;
}

double GenerateStats::decode_tok_s() const {
  return tokens.size() > 1 && decode_s > 0 ? static_cast<double>(tokens.size() - 1) / decode_s
                                           : 0.0;
}

double GenerateStats::acceptance() const {
  int drafted = 0, accepted = 0;
  for (const auto& [d, a] : rounds) {
    drafted += d;
    accepted += a;
  }
  return drafted > 0 ? static_cast<double>(accepted) / drafted : 0.0;
}

namespace {

double seconds_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string read_file(const std::string& path, const std::string& fix) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(path + ": cannot read (" + std::strerror(errno) + "); " + fix);
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw Error(path + ": cannot read; " + fix);
  return text.str();
}

bool file_exists(const std::string& path) { return std::ifstream(path).good(); }

int64_t element_count(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

// What a method takes or returns, as the manifest describes it.
struct IoSpec {
  std::string name;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
};

// A cache write the host applies after a method (runtime/runners/onnx.py's OnnxRunner "updates"):
// replace a whole host array with an output ("copy"), or write an output's rows into the
// array's slots ("rows": array[:, slots[r]] = output[:, r]).
struct HostUpdate {
  bool rows = false;
  std::string array;
  std::string output;
  std::string slots;
};

struct MethodIo {
  std::vector<IoSpec> inputs;                // the logical inputs, in order
  std::vector<IoSpec> outputs;               // the logical outputs, in order
  std::vector<std::string> host_inputs;      // host arrays fed after them, by name
  std::vector<std::string> host_outputs;     // what the runner returns after the logical ones
  std::vector<HostUpdate> updates;
};

// An array the host owns for the program: a cache buffer (ONNX) or slot positions (Core ML).
struct HostArray {
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  std::vector<float> f32;
  std::vector<int64_t> i64;
};

[[noreturn]] void bad_manifest(const std::string& what) {
  throw Error("manifest: " + what + "; export the bundle again");
}

DType parse_dtype(const json::Value& v, const std::string& where) {
  if (v.is_string() && v.as_string() == "float32") return DType::kFloat32;
  if (v.is_string() && v.as_string() == "int64") return DType::kInt64;
  bad_manifest(where + " has dtype " + (v.is_string() ? v.as_string() : v.dump()) +
               " (this app feeds float32 and int64)");
}

std::vector<int64_t> parse_shape(const json::Value& v, const std::string& where) {
  std::vector<int64_t> out;
  if (!v.is_array()) bad_manifest(where + " has no shape");
  for (const json::Value& d : v.as_array()) {
    if (!d.is_integer() || d.as_int() < 0) bad_manifest(where + " has a malformed shape");
    out.push_back(d.as_int());
  }
  return out;
}

// One entry of a method's inputs or outputs: [name, shape, dtype] (ExecuTorch), an object
// {name, shape, dtype} (ONNX, and the manifest's logical "methods"), or a bare name (Core ML),
// whose shape and dtype come from `logical` (the logical signature's entry at the same place).
IoSpec parse_io(const json::Value& v, const json::Value* logical, const std::string& where) {
  IoSpec spec;
  if (v.is_array() && v.size() == 3 && v[0].is_string()) {
    spec.name = v[0].as_string();
    spec.shape = parse_shape(v[1], where);
    spec.dtype = parse_dtype(v[2], where);
  } else if (v.is_object() && v.find("name") && v["name"].is_string()) {
    spec.name = v["name"].as_string();
    spec.shape = parse_shape(v.find("shape") ? v["shape"] : json::Value(), where);
    spec.dtype = parse_dtype(v.find("dtype") ? v["dtype"] : json::Value(), where);
  } else if (v.is_string() && logical != nullptr) {
    spec = parse_io(*logical, nullptr, where);
    spec.name = v.as_string();
  } else {
    bad_manifest(where + " is malformed");
  }
  return spec;
}

const json::Value& member(const json::Value& object, const std::string& key,
                          const std::string& where) {
  const json::Value* v = object.is_object() ? object.find(key) : nullptr;
  if (v == nullptr) bad_manifest("missing " + where + "." + key);
  return *v;
}

int manifest_int(const json::Value& object, const std::string& key, const std::string& where) {
  const json::Value& v = member(object, key, where);
  if (!v.is_integer()) bad_manifest(where + "." + key + " must be an integer");
  return v.as_int32();
}

bool is_draft_method(const std::string& method) { return method.rfind("draft_step", 0) == 0; }

std::string read_manifest(const std::string& dir) {
  const std::string path = dir + "/manifest.json";
  if (!file_exists(path)) {
    throw Error(path + ": missing (is " + dir +
                " an edgemtp export bundle? copy the whole bundle folder)");
  }
  return read_file(path, "copy the whole bundle folder");
}

}  // namespace

BundleConfig read_bundle_config(const std::string& bundle_dir) {
  return BundleConfig::from_manifest_text(read_manifest(bundle_dir));
}

// --- the engine --------------------------------------------------------------------------------

struct Engine::Impl : public Model {
  std::string dir;
  MethodRunner& runner;
  json::Value manifest;
  BundleConfig config;
  std::optional<Tokenizer> tokenizer;
  TokenTables tables;
  int hidden = 0;
  int num_layers = 0;
  int vocab = 0;
  std::map<std::string, MethodIo> io;
  std::map<std::string, HostArray> host;
  std::optional<Decoder> decoder;
  std::unique_ptr<DepthPolicy> adaptive;  // kept across generations, as Session.adaptive
  std::vector<int> cached;                 // the tokens whose K/V the cache holds

  // Model state: the last outputs (the logits rows handed out point into them) and the
  // drafter's hidden state.
  std::vector<Tensor> target_out;
  std::vector<Tensor> draft_out;
  int verify_pad = 0;
  std::vector<float> draft_hidden;
  std::map<std::string, double> seconds;  // running totals per phase

  Impl(const std::string& bundle_dir, MethodRunner& method_runner)
      : dir(bundle_dir), runner(method_runner) {
    while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
    const std::string text = read_manifest(dir);
    config = BundleConfig::from_manifest_text(text);
    manifest = json::Value::parse(text);
    const json::Value& model = member(manifest, "model", "manifest");
    hidden = manifest_int(model, "hidden_size", "model");
    num_layers = manifest_int(model, "num_layers", "model");
    vocab = config.vocab_size;

    const json::Value& description = member(manifest, "tables", "manifest");
    const json::Value& file = member(description, "file", "tables");
    if (!file.is_string()) bad_manifest("tables.file must be a file name");
    tables = TokenTables::open(dir + "/" + file.as_string(), description, hidden, vocab,
                               num_layers);

    const std::string tokenizer_path = dir + "/tokenizer.json";
    if (file_exists(tokenizer_path)) {
      tokenizer.emplace(Tokenizer::from_json_text(
          read_file(tokenizer_path, "copy the whole bundle folder")));
    }
    try {
      read_method_io();
    } catch (const json::TypeError& e) {
      bad_manifest(std::string("malformed method I/O (") + e.what() + ")");
    }
    decoder.emplace(config, *this);
  }

  // --- the program's calling protocol ----------------------------------------------------------

  void read_method_io() {
    const json::Value& method_io = member(manifest, "method_io", "manifest");
    const json::Value& logical = member(manifest, "methods", "manifest");
    for (const std::string& method : config.required_methods()) {
      const std::string where = "method_io." + method;
      const json::Value* declared = method_io.find(method);
      const json::Value& signature = member(logical, method, "methods");
      // A program that declares no I/O of its own (e.g. an ExecuTorch QNN program) takes the
      // logical signature.
      const json::Value& source = declared != nullptr ? *declared : signature;
      MethodIo m;
      const json::Value& inputs = member(source, "inputs", where);
      const json::Value& outputs = member(source, "outputs", where);
      const json::Value& logical_in = member(signature, "inputs", "methods." + method);
      const json::Value& logical_out = member(signature, "outputs", "methods." + method);
      if (!inputs.is_array() || !outputs.is_array() || !logical_in.is_array() ||
          !logical_out.is_array()) {
        bad_manifest(where + " must list its inputs and outputs");
      }
      for (std::size_t i = 0; i < inputs.size(); ++i) {
        const std::string name = inputs[i].is_string() ? inputs[i].as_string() : "";
        if (name.rfind("pos_", 0) == 0) {  // Core ML: slot positions the host owns
          m.host_inputs.push_back(name);
          continue;
        }
        const json::Value* l = i < logical_in.size() ? &logical_in[i] : nullptr;
        m.inputs.push_back(parse_io(inputs[i], l, where + ".inputs"));
      }
      for (std::size_t i = 0; i < outputs.size(); ++i) {
        const std::string name = outputs[i].is_string() ? outputs[i].as_string() : "";
        if (name.rfind("new_pos_", 0) == 0) {
          m.host_outputs.push_back(name);
          m.updates.push_back({false, name.substr(4), name, ""});
          continue;
        }
        if (!m.host_outputs.empty()) bad_manifest(where + ": slot positions must come last");
        const json::Value* l = i < logical_out.size() ? &logical_out[i] : nullptr;
        m.outputs.push_back(parse_io(outputs[i], l, where + ".outputs"));
      }
      if (const json::Value* cache_inputs = source.find("cache_inputs")) {  // ONNX
        for (const json::Value& name : cache_inputs->as_array()) {
          m.host_inputs.push_back(name.as_string());
        }
        for (const json::Value& out : member(source, "cache_outputs", where).as_array()) {
          m.host_outputs.push_back(parse_io(out, nullptr, where + ".cache_outputs").name);
        }
      }
      check_signature(method, m);
      io[method] = std::move(m);
    }
    if (config.backend == "onnx") read_onnx_index();
    if (config.backend == "coreml") read_coreml_positions();
    for (const auto& [method, m] : io) {
      for (const std::string& name : m.host_inputs) {
        if (!host.count(name)) bad_manifest(method + " reads '" + name + "', which no cache holds");
      }
    }
  }

  // The inputs and outputs this engine feeds and reads, by place (names differ by backend).
  void check_signature(const std::string& method, const MethodIo& m) const {
    const std::string where = "method_io." + method;
    const auto expect = [&](const std::vector<IoSpec>& specs, std::size_t i, DType dtype,
                            std::vector<int64_t> shape, const char* role) {
      if (i >= specs.size()) bad_manifest(where + " has no " + role);
      const IoSpec& s = specs[i];
      if (s.dtype != dtype || (!shape.empty() && s.shape != shape)) {
        bad_manifest(where + " " + role + " '" + s.name + "' is " + shape_text(s.shape) +
                     ", this model needs " + shape_text(shape));
      }
    };
    const int ple = tables.has_per_layer() ? tables.per_layer_dim() : 1;
    if (is_draft_method(method)) {
      expect(m.inputs, 0, DType::kFloat32, {hidden}, "token embedding input");
      expect(m.inputs, 1, DType::kFloat32, {hidden}, "hidden input");
      expect(m.inputs, 2, DType::kInt64, {1}, "position input");
      expect(m.outputs, 0, DType::kFloat32, {hidden}, "hidden output");
      expect(m.outputs, 1, DType::kInt64, {}, "token ids output");
      const std::vector<int64_t> candidates =
          m.outputs.size() > 1 ? m.outputs[1].shape : std::vector<int64_t>{};
      expect(m.outputs, 2, DType::kFloat32, candidates, "logits output");
      return;
    }
    const int64_t rows = m.inputs.empty() || m.inputs[0].shape.empty() ? 0 : m.inputs[0].shape[0];
    expect(m.inputs, 0, DType::kFloat32, {rows, hidden}, "embeddings input");
    expect(m.inputs, 1, DType::kFloat32, {rows, num_layers, ple}, "per-layer input");
    expect(m.inputs, 2, DType::kInt64, {rows}, "positions input");
    if (method.rfind("prefill_final", 0) == 0) {
      expect(m.outputs, 0, DType::kFloat32, {hidden}, "hidden output");
      expect(m.outputs, 1, DType::kFloat32, {vocab}, "logits output");
    } else if (method.rfind("prefill_intermediate", 0) != 0) {
      expect(m.outputs, 0, DType::kFloat32, {rows, vocab}, "logits output");
      expect(m.outputs, 1, DType::kFloat32, {rows, hidden}, "hidden output");
    }
  }

  // ONNX: the cache arrays and the writes after each method, from the program's own index
  // (the methods.json OnnxRunner reads).
  void read_onnx_index() {
    const std::string path = dir + "/" + config.program + "/methods.json";
    json::Value index;
    try {
      index = json::Value::parse(read_file(path, "copy the whole bundle folder"));
    } catch (const json::ParseError& e) {
      throw Error(path + ": not valid JSON (" + e.what() + "); export the bundle again");
    }
    const std::string where = config.program + "/methods.json";
    for (const auto& [name, spec] : member(index, "cache", where).as_object()) {
      HostArray a;
      a.shape = parse_shape(member(spec, "shape", where), where + " cache " + name);
      a.dtype = parse_dtype(member(spec, "dtype", where), where + " cache " + name);
      const json::Value& fill = member(spec, "fill", where);
      const auto n = static_cast<std::size_t>(element_count(a.shape));
      if (a.dtype == DType::kFloat32) a.f32.assign(n, static_cast<float>(fill.as_number()));
      else a.i64.assign(n, fill.as_int());
      host[name] = std::move(a);
    }
    const json::Value& methods = member(index, "methods", where);
    for (auto& [method, m] : io) {
      const json::Value& updates = member(member(methods, method, where), "updates", where);
      for (const json::Value& u : updates.as_array()) {
        const std::string kind = member(u, "kind", where).as_string();
        HostUpdate update{kind == "rows", member(u, "cache", where).as_string(),
                          member(u, "output", where).as_string(), ""};
        if (update.rows) update.slots = member(u, "slots", where).as_string();
        else if (kind != "copy") bad_manifest(where + ": unknown cache update '" + kind + "'");
        m.updates.push_back(update);
      }
    }
  }

  // Core ML: the slot positions of each cache kind live on the host (int32 in the package,
  // -1 = empty; the platform runner converts), replaced by each function's new_pos_<kind>.
  void read_coreml_positions() {
    const json::Value& details = member(manifest, "backend_details", "manifest");
    const json::Value& package = member(details, "package", "backend_details");
    const json::Value& functions = member(package, "functions", "backend_details.package");
    for (const auto& [method, m] : io) {
      const json::Value& inputs = member(member(functions, method, "package.functions"), "inputs",
                                         "package.functions." + method);
      for (const std::string& name : m.host_inputs) {
        if (host.count(name)) continue;
        HostArray a;
        a.dtype = DType::kInt64;
        a.shape = parse_shape(member(member(inputs, name, method), "shape", name), name);
        a.i64.assign(static_cast<std::size_t>(element_count(a.shape)), -1);
        host[name] = std::move(a);
      }
    }
  }

  // Runs `method` on the logical inputs (+ the host arrays), applies the host writes, and
  // returns the logical outputs.
  std::vector<Tensor> call(const std::string& method, std::vector<TensorView> inputs) {
    const MethodIo& m = io.at(method);
    for (std::size_t i = 0; i < inputs.size(); ++i) inputs[i].name = m.inputs[i].name;
    for (const std::string& name : m.host_inputs) {
      HostArray& a = host.at(name);
      const void* data = a.dtype == DType::kFloat32 ? static_cast<const void*>(a.f32.data())
                                                    : static_cast<const void*>(a.i64.data());
      inputs.push_back({name, a.dtype, a.shape, data});
    }
    const double t0 = seconds_now();
    std::vector<Tensor> out = runner.run(method, inputs);
    seconds[is_draft_method(method) ? "drafter" : "target"] += seconds_now() - t0;
    const std::size_t expected = m.outputs.size() + m.host_outputs.size();
    if (out.size() != expected) {
      throw Error(method + " returned " + std::to_string(out.size()) + " outputs, the manifest "
                  "declares " + std::to_string(expected));
    }
    for (std::size_t i = 0; i < m.outputs.size(); ++i) check_output(method, m.outputs[i], out[i]);
    if (!m.updates.empty()) {
      std::map<std::string, const Tensor*> named;
      for (std::size_t i = 0; i < m.host_outputs.size(); ++i) {
        named[m.host_outputs[i]] = &out[m.outputs.size() + i];
      }
      for (const HostUpdate& u : m.updates) apply(method, u, named);
    }
    out.resize(m.outputs.size());
    return out;
  }

  static void check_output(const std::string& method, const IoSpec& spec, const Tensor& t) {
    const std::size_t n = spec.dtype == DType::kFloat32 ? t.f32.size() : t.i64.size();
    if (t.dtype != spec.dtype || static_cast<int64_t>(n) != element_count(spec.shape)) {
      throw Error(method + " output '" + spec.name + "' has " + std::to_string(n) +
                  " elements of the wrong kind or number (the manifest declares " +
                  shape_text(spec.shape) + ")");
    }
  }

  void apply(const std::string& method, const HostUpdate& u,
             const std::map<std::string, const Tensor*>& named) {
    auto found = named.find(u.output);
    if (found == named.end()) throw Error(method + " returned no '" + u.output + "'");
    const Tensor& t = *found->second;
    HostArray& a = host.at(u.array);
    const std::string bad = method + "'s '" + u.output + "' does not fit '" + u.array + "'";
    if (t.dtype != a.dtype) throw Error(bad);
    if (!u.rows) {
      const bool fits = a.dtype == DType::kFloat32 ? t.f32.size() == a.f32.size()
                                                   : t.i64.size() == a.i64.size();
      if (!fits) throw Error(bad);
      a.f32 = t.f32;
      a.i64 = t.i64;
      return;
    }
    // array[:, slots[r]] = rows[:, r]: [outer, slots, inner] <- [outer, rows, inner].
    auto slot_tensor = named.find(u.slots);
    if (slot_tensor == named.end() || slot_tensor->second->dtype != DType::kInt64) {
      throw Error(method + " returned no slot indices '" + u.slots + "'");
    }
    const std::vector<int64_t>& slots = slot_tensor->second->i64;
    if (a.shape.size() < 2 || t.shape.size() != a.shape.size() || t.shape[0] != a.shape[0] ||
        t.shape[1] != static_cast<int64_t>(slots.size())) {
      throw Error(bad);
    }
    const int64_t outer = a.shape[0], capacity = a.shape[1], rows = t.shape[1];
    const int64_t inner = element_count(a.shape) / (outer * capacity);
    if (element_count(t.shape) != outer * rows * inner) throw Error(bad);
    for (int64_t o = 0; o < outer; ++o) {
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t slot = slots[static_cast<std::size_t>(r)];
        if (slot < 0 || slot >= capacity) {
          throw Error(method + " wrote slot " + std::to_string(slot) + " of " +
                      std::to_string(capacity));
        }
        const int64_t from = (o * rows + r) * inner, to = (o * capacity + slot) * inner;
        if (a.dtype == DType::kFloat32) {
          std::copy_n(t.f32.begin() + from, inner, a.f32.begin() + to);
        } else {
          std::copy_n(t.i64.begin() + from, inner, a.i64.begin() + to);
        }
      }
    }
  }

  // --- Model -----------------------------------------------------------------------------------

  // StaticBackend._padded: the rows' embeddings and per-layer rows after `pad` zero rows, and
  // every row's position.
  struct RowInputs {
    std::vector<float> embeds, ple;
    std::vector<int64_t> positions;
  };

  RowInputs row_inputs(const RowCall& c) {
    const MethodIo& m = io.at(c.method);
    const int total = c.rows + c.pad;
    if (m.inputs[0].shape[0] != total) {
      throw Error(c.method + " takes " + std::to_string(m.inputs[0].shape[0]) +
                  " rows, called with " + std::to_string(total));
    }
    const double t0 = seconds_now();
    RowInputs in;
    in.embeds.assign(static_cast<std::size_t>(total) * hidden, 0.0f);
    in.ple.assign(static_cast<std::size_t>(element_count(m.inputs[1].shape)), 0.0f);
    tables.embed(c.ids, in.embeds.data() + static_cast<std::size_t>(c.pad) * hidden);
    if (tables.has_per_layer()) {  // otherwise the graph takes a placeholder it never reads
      const std::size_t row = static_cast<std::size_t>(num_layers) * tables.per_layer_dim();
      tables.per_layer_inputs(c.ids, in.ple.data() + c.pad * row);
    }
    for (int p : c.positions()) in.positions.push_back(p);
    seconds["embed"] += seconds_now() - t0;
    return in;
  }

  std::vector<Tensor> run_rows(const RowCall& c) {
    RowInputs in = row_inputs(c);
    const MethodIo& m = io.at(c.method);
    return call(c.method, {{"", DType::kFloat32, m.inputs[0].shape, in.embeds.data()},
                           {"", DType::kFloat32, m.inputs[1].shape, in.ple.data()},
                           {"", DType::kInt64, m.inputs[2].shape, in.positions.data()}});
  }

  void prefill_intermediate(const RowCall& c) override { run_rows(c); }

  LogitsRow prefill_final(const RowCall& c) override {
    target_out = run_rows(c);  // hidden [H], logits [V]: the last row's
    draft_hidden = target_out[0].f32;
    return {target_out[1].f32.data(), vocab};
  }

  std::vector<LogitsRow> verify(const RowCall& c) override {
    target_out = run_rows(c);  // logits [rows, V], hidden [rows, H]
    verify_pad = c.pad;
    std::vector<LogitsRow> rows;
    for (int r = c.pad; r < c.pad + c.rows; ++r) {
      rows.push_back({target_out[0].f32.data() + static_cast<std::size_t>(r) * vocab, vocab});
    }
    return rows;
  }

  void draft_from_verify_row(int row) override {
    const float* h = target_out[1].f32.data() + static_cast<std::size_t>(verify_pad + row) * hidden;
    draft_hidden.assign(h, h + hidden);
  }

  DraftLogits draft_step(const std::string& method, int token, int position) override {
    const double t0 = seconds_now();
    std::vector<float> embed(static_cast<std::size_t>(hidden));
    tables.embed({token}, embed.data());
    seconds["embed"] += seconds_now() - t0;
    int64_t pos = position;
    draft_out = call(method, {{"", DType::kFloat32, {hidden}, embed.data()},
                              {"", DType::kFloat32, {hidden}, draft_hidden.data()},
                              {"", DType::kInt64, {1}, &pos}});
    draft_hidden = draft_out[0].f32;
    if (draft_out[1].i64.size() != draft_out[2].f32.size()) {
      throw Error(method + " returned " + std::to_string(draft_out[1].i64.size()) +
                  " token ids for " + std::to_string(draft_out[2].f32.size()) + " logits");
    }
    return {{draft_out[2].f32.data(), static_cast<int>(draft_out[2].f32.size())},
            draft_out[1].i64.data()};
  }

  // --- generation ------------------------------------------------------------------------------

  DepthPolicy& policy(int depth, std::unique_ptr<DepthPolicy>& pinned) {
    const int max_draft = config.has_drafter ? config.shapes.max_draft : 0;
    if (depth < 0) {
      if (max_draft == 0) {
        pinned = std::make_unique<FixedDepth>(0);
        return *pinned;
      }
      if (!adaptive) adaptive = std::make_unique<AdaptiveDepth>(config.shapes);
      return *adaptive;
    }
    if (depth > 0 && !config.has_drafter) {
      throw Error("depth " + std::to_string(depth) +
                  " needs a drafter; this bundle has none (use 0)");
    }
    if (depth > max_draft) {
      throw Error("depth " + std::to_string(depth) + ": this bundle verifies at most " +
                  std::to_string(max_draft) + " drafts (export with --draft-depth " +
                  std::to_string(depth) + " for more)");
    }
    pinned = std::make_unique<FixedDepth>(depth);
    return *pinned;
  }

  std::vector<int> default_stop_ids() const {
    std::vector<int> out = config.eos_token_ids;
    if (tokenizer) {
      if (std::optional<int> end = tokenizer->end_of_turn_id()) out.push_back(*end);
    }
    return out;
  }

  // Session.truncate: keep the first `length` cached tokens, or none when a ring lost them.
  void truncate_cached(int length) {
    if (length >= static_cast<int>(cached.size())) return;
    const bool keeps = decoder->truncate(length);
    if (keeps) cached.resize(static_cast<std::size_t>(length));
    else cached.clear();
  }

  GenerateStats generate(const std::vector<int>& prompt, const GenerateOptions& options) {
    if (prompt.empty()) throw Error("the prompt is empty");
    for (int t : prompt) {
      if (t < 0 || t >= vocab) {
        throw Error("prompt id " + std::to_string(t) + " is outside the vocabulary (0.." +
                    std::to_string(vocab - 1) + ")");
      }
    }
    if (static_cast<int>(prompt.size()) >= config.shapes.max_context) {
      throw Error("the prompt has " + std::to_string(prompt.size()) +
                  " tokens; this model's context holds " +
                  std::to_string(config.shapes.max_context) +
                  " (export with a larger --max-context, or start a new chat)");
    }
    std::unique_ptr<DepthPolicy> pinned;
    DepthPolicy& depth_policy = policy(options.depth, pinned);
    // The longest cached prefix of the prompt; its last token always runs again (it yields
    // the first logits).
    std::size_t common = 0;
    while (common < cached.size() && common + 1 < prompt.size() &&
           cached[common] == prompt[common]) {
      ++common;
    }
    truncate_cached(static_cast<int>(common));

    GenerateStats stats;
    stats.prompt_tokens = static_cast<int>(prompt.size());
    stats.reused_tokens = static_cast<int>(cached.size());
    std::optional<Tokenizer::Stream> stream;
    if (tokenizer && options.on_text) stream.emplace(*tokenizer);
    std::map<std::string, double> at_first_token;
    bool first = true;
    double t_first = 0, t_last = 0;

    DecodeOptions decode;
    decode.max_new_tokens = options.max_new_tokens;
    decode.stop_ids = options.stop_ids.empty() ? default_stop_ids() : options.stop_ids;
    decode.sampling = options.sampling;
    decode.reused = stats.reused_tokens;
    decode.should_stop = options.should_stop;
    decode.clock = seconds_now;
    decode.on_tokens = [&](const std::vector<int>& ids) {
      t_last = seconds_now();
      if (first) {
        first = false;
        t_first = t_last;
        at_first_token = seconds;
      }
      if (stream) {
        std::string text;
        for (int id : ids) text += stream->push(id);
        options.on_text(text, ids);
      }
    };
    const double t_start = seconds_now();
    Generation g;
    try {
      g = decoder->generate(prompt, depth_policy, decode);
    } catch (...) {
      cached.clear();  // the cache is in an unknown state: the next call starts afresh
      decoder->reset();
      throw;
    }
    cached = prompt;
    cached.insert(cached.end(), g.tokens.begin(), g.tokens.end() - 1);  // the last is not cached

    if (stream) {
      std::string rest = stream->finish();
      if (!rest.empty()) options.on_text(rest, {});
    }
    stats.tokens = g.tokens;
    stats.stop_reason = g.stop_reason;
    if (tokenizer) stats.text = tokenizer->decode(g.tokens);
    stats.ttft_s = t_first - t_start;
    stats.decode_s = t_last - t_first;
    for (const Round& r : g.rounds) stats.rounds.emplace_back(r.depth, r.accepted);
    // Decode rounds only, as runtime.generate's decode_seconds_by_phase; host: the rest.
    double measured = 0;
    for (const char* phase : {"embed", "target", "drafter"}) {
      auto before = at_first_token.find(phase);
      double s = seconds[phase] - (before == at_first_token.end() ? 0.0 : before->second);
      stats.seconds_by_phase[phase] = s;
      measured += s;
    }
    stats.seconds_by_phase["host"] = std::max(0.0, stats.decode_s - measured);
    return stats;
  }
};

Engine::Engine(const std::string& bundle_dir, MethodRunner& runner)
    : impl_(std::make_unique<Impl>(bundle_dir, runner)) {}

Engine::~Engine() = default;

const BundleConfig& Engine::config() const { return impl_->config; }

bool Engine::has_tokenizer() const { return impl_->tokenizer.has_value(); }
std::vector<int> Engine::default_stop_ids() const { return impl_->default_stop_ids(); }

const Tokenizer& Engine::tokenizer() const {
  if (!impl_->tokenizer) {
    throw Error(impl_->dir + "/tokenizer.json: missing; this bundle takes token ids only (export "
                "it from a model folder that has a tokenizer.json)");
  }
  return *impl_->tokenizer;
}

const TokenTables& Engine::tables() const { return impl_->tables; }

GenerateStats Engine::generate_text(std::string_view prompt, const GenerateOptions& options) {
  return impl_->generate(tokenizer().encode_prompt(prompt, options.chat), options);
}

GenerateStats Engine::generate(const std::vector<int>& prompt, const GenerateOptions& options) {
  return impl_->generate(prompt, options);
}

void Engine::reset() {
  impl_->cached.clear();
  impl_->decoder->reset();
}

}  // namespace edgemtp
