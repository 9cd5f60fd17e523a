// runtime/bench.py's run_bench, _run, PromptMaker and bundle_info in C++, writing the document
// result_document writes, less "summary" (`edgemtp bench collect` computes it from the runs:
// statistics.stdev's exact arithmetic is not worth porting) and "predictions" (the host's).
#include "edgemtp/bench.h"

#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <string_view>

#include "edgemtp/json.h"
#include "edgemtp/sha256.h"

namespace edgemtp {

namespace {

constexpr const char* kSchema = "edgemtp-bench/1";
// GenerateOptions::stop_ids empty means the bundle's stop ids; bench.py decodes with none
// (stop_ids=()) so that every run makes its full budget. No token has this id.
constexpr int kNoStopId = -1;

// --- Python's random.Random(str) -----------------------------------------------------------

// CPython's MT19937 (Modules/_randommodule.c) as random.Random(text) seeds it, and its
// _randbelow_with_getrandbits, so that choice() picks what Python picks.
class PythonRandom {
 public:
  explicit PythonRandom(const std::string& text) {
    // random.seed(str): int.from_bytes(text + sha512(text)), big-endian; init_by_array takes
    // that number's 32-bit words, least significant first, without leading zero words.
    std::string bytes = text;
    auto digest = sha512(text);
    bytes.append(reinterpret_cast<const char*>(digest.data()), digest.size());
    std::vector<uint32_t> key;
    for (size_t end = bytes.size(); end > 0;) {
      size_t begin = end >= 4 ? end - 4 : 0;
      uint32_t word = 0;
      for (size_t i = begin; i < end; ++i) word = word << 8 | static_cast<unsigned char>(bytes[i]);
      key.push_back(word);
      end = begin;
    }
    while (key.size() > 1 && key.back() == 0) key.pop_back();
    init_by_array(key);
  }

  uint32_t next32() {
    if (index_ >= kN) twist();
    uint32_t y = state_[index_++];
    y ^= y >> 11;
    y ^= (y << 7) & 0x9d2c5680U;
    y ^= (y << 15) & 0xefc60000U;
    y ^= y >> 18;
    return y;
  }

  // random._randbelow_with_getrandbits(n): getrandbits(n.bit_length()) until below n.
  uint32_t below(uint32_t n) {
    int bits = 0;
    while (bits < 32 && (n >> bits) != 0) ++bits;
    uint32_t r;
    do {
      r = next32() >> (32 - bits);
    } while (r >= n);
    return r;
  }

 private:
  static constexpr int kN = 624, kM = 397;

  void init_genrand(uint32_t seed) {
    state_[0] = seed;
    for (int i = 1; i < kN; ++i) {
      state_[i] = 1812433253U * (state_[i - 1] ^ (state_[i - 1] >> 30)) + static_cast<uint32_t>(i);
    }
    index_ = kN;
  }

  void init_by_array(const std::vector<uint32_t>& key) {
    init_genrand(19650218U);
    int i = 1;
    size_t j = 0;
    for (size_t k = std::max<size_t>(kN, key.size()); k > 0; --k) {
      state_[i] = (state_[i] ^ ((state_[i - 1] ^ (state_[i - 1] >> 30)) * 1664525U)) + key[j] +
                  static_cast<uint32_t>(j);
      ++i;
      ++j;
      if (i >= kN) {
        state_[0] = state_[kN - 1];
        i = 1;
      }
      if (j >= key.size()) j = 0;
    }
    for (int k = kN - 1; k > 0; --k) {
      state_[i] = (state_[i] ^ ((state_[i - 1] ^ (state_[i - 1] >> 30)) * 1566083941U)) -
                  static_cast<uint32_t>(i);
      ++i;
      if (i >= kN) {
        state_[0] = state_[kN - 1];
        i = 1;
      }
    }
    state_[0] = 0x80000000U;
  }

  void twist() {
    auto mix = [&](int k, int next, int far) {
      uint32_t y = (state_[k] & 0x80000000U) | (state_[next] & 0x7fffffffU);
      state_[k] = state_[far] ^ (y >> 1) ^ ((y & 1U) ? 0x9908b0dfU : 0U);
    };
    for (int k = 0; k < kN; ++k) mix(k, (k + 1) % kN, (k + kM) % kN);
    index_ = 0;
  }

  std::array<uint32_t, kN> state_{};
  int index_ = kN;
};

// --- JSON values ---------------------------------------------------------------------------

// `text` with every byte that is not part of well-formed UTF-8 replaced by '?': an error
// message may carry any bytes, and a result file must decode as UTF-8 where it is read.
std::string utf8(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  size_t i = 0;
  while (i < text.size()) {
    auto byte = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
    unsigned char lead = byte(i);
    size_t length = 0;
    unsigned char low = 0x80, high = 0xBF;  // the second byte's range (Unicode table 3-7)
    if (lead < 0x80) {
      length = 1;
    } else if (lead >= 0xC2 && lead <= 0xDF) {
      length = 2;
    } else if (lead >= 0xE0 && lead <= 0xEF) {
      length = 3;
      if (lead == 0xE0) low = 0xA0;
      if (lead == 0xED) high = 0x9F;
    } else if (lead >= 0xF0 && lead <= 0xF4) {
      length = 4;
      if (lead == 0xF0) low = 0x90;
      if (lead == 0xF4) high = 0x8F;
    }
    bool ok = length > 0 && i + length <= text.size();
    for (size_t k = 1; ok && k < length; ++k) {
      unsigned char c = byte(i + k);
      ok = k == 1 ? (c >= low && c <= high) : (c >= 0x80 && c <= 0xBF);
    }
    if (ok) {
      out.append(text, i, length);
      i += length;
    } else {
      out += '?';
      ++i;
    }
  }
  return out;
}

json::Value number(double x) { return std::isfinite(x) ? json::Value(x) : json::Value(); }
json::Value string_or_null(const std::string& text) {
  return text.empty() ? json::Value() : json::Value(utf8(text));
}

json::Value int_array(const std::vector<int>& values) {
  json::Array items;
  items.reserve(values.size());
  for (int v : values) items.emplace_back(v);
  return items;
}

std::string list_text(const std::vector<int>& values) {
  std::string text = "[";
  for (size_t i = 0; i < values.size(); ++i) text += (i ? ", " : "") + std::to_string(values[i]);
  return text + "]";
}

// --- the plan ------------------------------------------------------------------------------

// BenchPlan.check; the flags named are `edgemtp bench`'s, which the apps' settings mirror.
void check_plan(const BenchPlan& plan, const BundleConfig& config) {
  for (const auto& [name, values] : {std::pair{"--pp", &plan.pp}, std::pair{"--tg", &plan.tg}}) {
    if (std::any_of(values->begin(), values->end(), [](int v) { return v < 1; })) {
      throw Error(std::string(name) + " " + list_text(*values) + ": token counts must be >= 1");
    }
  }
  if (plan.pp.empty() && plan.tg.empty()) throw Error("nothing to measure: give --pp and/or --tg");
  if (plan.repeat < 1) {
    throw Error("--repeat " + std::to_string(plan.repeat) + ": run each test at least once");
  }
  if (plan.tg_prompt < 1) {
    throw Error("--tg-prompt " + std::to_string(plan.tg_prompt) + ": a prompt needs a token");
  }
  // bench.py fails later (max() of nothing) and the schema wants a depth: say so up front.
  if (plan.depths.empty()) throw Error("--mtp: give at least one depth (0 = AR)");
  std::vector<int> pinned;
  for (int d : plan.depths) {
    if (d != kAutoDepth) pinned.push_back(d);
  }
  int deepest = pinned.empty() ? 0 : *std::max_element(pinned.begin(), pinned.end());
  if (deepest > 0 && !config.has_drafter) {
    throw Error("--mtp " + std::to_string(deepest) +
                " needs a drafter; this bundle has none (--mtp 0)");
  }
  if (pinned.size() < plan.depths.size() && !config.has_drafter) {
    throw Error("--mtp auto adapts the draft depth: this bundle has no drafter");
  }
  if (deepest > config.shapes.max_draft) {
    throw Error("--mtp " + std::to_string(deepest) + ": this bundle verifies at most " +
                std::to_string(config.shapes.max_draft) + " drafts (export with --draft-depth " +
                std::to_string(deepest) + " for more)");
  }
  if (!pinned.empty() && *std::min_element(pinned.begin(), pinned.end()) < 0) {
    throw Error("--mtp " + list_text(plan.depths) + ": depths are >= 0 (0 = AR)");
  }
}

std::string depth_text(int depth) {
  return depth == kAutoDepth ? "auto" : std::to_string(depth);
}

json::Value depth_value(int depth) {
  return depth == kAutoDepth ? json::Value("auto") : json::Value(depth);
}

json::Value depths_array(const std::vector<int>& depths) {
  json::Array out;
  for (int d : depths) out.push_back(depth_value(d));
  return out;
}

// --- the bundle ----------------------------------------------------------------------------

std::string read_text(const std::string& path) {
  std::FILE* file = std::fopen(path.c_str(), "rb");
  if (file == nullptr) throw Error(path + ": cannot read it (is this a bundle folder?)");
  std::string text;
  char buffer[1 << 14];
  size_t got;
  while ((got = std::fread(buffer, 1, sizeof buffer, file)) > 0) text.append(buffer, got);
  bool failed = std::ferror(file) != 0;
  std::fclose(file);
  if (failed) throw Error(path + ": cannot read it");
  return text;
}

// The bytes of every file under `folder` as pathlib's rglob("*") finds them: a link to a file
// counts its target, a link to a folder is not followed.
int64_t folder_bytes(const std::string& folder) {
  DIR* dir = opendir(folder.c_str());
  if (dir == nullptr) throw Error(folder + ": cannot list it");
  std::vector<std::string> names;
  while (dirent* entry = readdir(dir)) {
    std::string name = entry->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  closedir(dir);
  int64_t total = 0;
  for (const std::string& name : names) {
    std::string path = folder + "/" + name;
    struct stat info {};
    if (lstat(path.c_str(), &info) != 0) continue;
    if (S_ISDIR(info.st_mode)) {
      total += folder_bytes(path);
    } else if (S_ISLNK(info.st_mode)) {
      if (stat(path.c_str(), &info) == 0 && S_ISREG(info.st_mode)) total += info.st_size;
    } else if (S_ISREG(info.st_mode)) {
      total += info.st_size;
    }
  }
  return total;
}

// bundle_info: the bundle's name, the SHA-256 of its manifest (which holds every file's), its
// size, and what runs it.
json::Object bundle_info(const std::string& bundle_dir, const BundleConfig& config) {
  std::string manifest_path = bundle_dir + "/manifest.json";
  std::string manifest_text = read_text(manifest_path);
  json::Value manifest;
  try {
    manifest = json::Value::parse(manifest_text);
  } catch (const json::ParseError& err) {
    throw Error(manifest_path + ": not JSON (" + err.what() + ")");
  }
  const json::Value* quantization = manifest.is_object() ? manifest.find("quantization") : nullptr;
  const json::Value* scheme =
      quantization && quantization->is_object() ? quantization->find("scheme") : nullptr;
  if (scheme == nullptr || !scheme->is_string()) {
    throw Error(manifest_path + ": no quantization.scheme (export the bundle again)");
  }

  std::string folder = bundle_dir;
  if (char* resolved = realpath(bundle_dir.c_str(), nullptr)) {
    folder = resolved;
    std::free(resolved);
  }
  while (folder.size() > 1 && folder.back() == '/') folder.pop_back();
  size_t slash = folder.rfind('/');
  std::string name = slash == std::string::npos ? folder : folder.substr(slash + 1);
  if (name == "bundle" && slash != std::string::npos && slash > 0) {
    // a folder called "bundle" (as `edgemtp demo` caches it) is named by its parent
    size_t parent = folder.rfind('/', slash - 1);
    name = folder.substr(parent + 1, slash - parent - 1) + "/bundle";
  }

  return {
      {"path", utf8(bundle_dir)},
      {"name", utf8(name)},
      {"sha256", sha256_hex(manifest_text)},
      {"bytes", folder_bytes(folder)},
      {"backend", config.backend},
      {"delegate", config.delegate},
      {"quantization", utf8(scheme->as_string())},
      {"max_context", config.shapes.max_context},
      {"max_draft", config.shapes.max_draft},
  };
}

json::Object machine_info(const MachineInfo& machine) {
  json::Object libraries;
  for (const auto& [library, version] : machine.libraries) {
    libraries[utf8(library)] = string_or_null(version);
  }
  json::Object out = {
      {"platform", machine.platform.empty() ? "host" : machine.platform},
      {"cpu", utf8(machine.cpu)},
      {"cores", machine.cores > 0 ? json::Value(machine.cores) : json::Value()},
      {"memory_gib", machine.memory_gib > 0 ? number(machine.memory_gib) : json::Value()},
      {"os", utf8(machine.os)},
      {"threads", std::max(machine.threads, 1)},
      {"libraries", libraries},
  };
  // absent on a host, as bench.py's machine_info leaves them
  if (!machine.device.empty()) out["device"] = utf8(machine.device);
  if (!machine.profile.empty()) out["profile"] = utf8(machine.profile);
  return out;
}

// --- running -------------------------------------------------------------------------------

struct Measured {
  json::Object record;
  std::optional<std::vector<int>> tokens;  // when the run completed
};

// bench.py's _run: one generation from a reset cache, greedy, the depth (pinned or the
// Engine's adaptive one), no stop ids.
Measured measure(BenchTarget& target, const std::string& test, int depth, int round,
                 const std::vector<int>& prompt, int gen, const std::vector<int>* ar_tokens,
                 const BenchHooks& hooks) {
  Measured out;
  json::Object& record = out.record;
  record = {
      {"test", test},
      {"depth", depth_value(depth)},
      {"round", round},
      {"warmup", round < 0},
      {"prompt_tokens", static_cast<int64_t>(prompt.size())},
      {"prompt_sha256", prompt_sha256(prompt)},
      {"acceptance_oracle", nullptr},
  };
  GenerateOptions options;
  options.max_new_tokens = gen;
  options.depth = depth;
  options.stop_ids = {kNoStopId};
  GenerateStats stats;
  std::optional<BatteryReading> before, after;
  try {
    target.reset();
    if (hooks.battery_before) before = hooks.battery_before();
    stats = target.generate(prompt, options);
    if (hooks.battery_after) after = hooks.battery_after();
  } catch (const std::exception& err) {
    // bench.py records EdgeMTPError; on a phone a runner's own exception is as much a failed
    // run, and recording it keeps the rest of the bench.
    record["error"] = utf8(err.what());
    return out;
  }

  auto n_out = static_cast<int64_t>(stats.tokens.size());
  json::Array rounds;
  for (const auto& [drafted, accepted] : stats.rounds) rounds.push_back(json::Array{drafted, accepted});
  json::Object phases;
  for (const auto& [phase, seconds] : stats.seconds_by_phase) phases[phase] = number(seconds);
  json::Value valid;  // null: AR, or no AR tokens to compare with
  if (depth != 0 && ar_tokens != nullptr) valid = stats.tokens == *ar_tokens;

  record["tokens"] = int_array(stats.tokens);
  record["generated_tokens"] = n_out;
  record["ttft_s"] = number(stats.ttft_s);
  record["prefill_tok_s"] =
      stats.ttft_s > 0 ? number(static_cast<double>(prompt.size()) / stats.ttft_s) : json::Value();
  record["decode_tok_s"] = n_out > 1 && stats.decode_s > 0
                               ? number(static_cast<double>(n_out - 1) / stats.decode_s)
                               : json::Value();
  record["decode_s"] = number(stats.decode_s);
  record["rounds"] = rounds;
  record["decode_seconds_by_phase"] = phases;
  record["valid"] = valid;
  record["error"] = nullptr;
  if (before && after) {
    json::Object battery{
        {"source", utf8(before->source)},
        {"unit", utf8(before->unit)},
        {"start", number(before->start)},
        {"end", number(after->end)},
    };
    for (const auto& [key, value] : before->extra) battery[key + "_start"] = utf8(value);
    for (const auto& [key, value] : after->extra) battery[key + "_end"] = utf8(value);
    record["battery"] = std::move(battery);
  }
  out.tokens = std::move(stats.tokens);
  return out;
}

struct Test {
  std::string name;
  int prompt_len = 0;
  int gen = 0;
  std::vector<int> depths;
};

// Every run of every test, warm-ups included (flagged), in the order they ran: bench.py's
// run_bench. Stops early (returning the runs so far) when hooks.should_stop says so.
json::Array run_tests(BenchTarget& target, const BenchPlan& plan, const BenchHooks& hooks) {
  const BundleConfig& config = target.config();
  PromptMaker prompts(config.vocab_size, target.stop_ids(), plan.seed);
  int limit = config.shapes.max_context;

  std::vector<Test> tests;
  for (int n : plan.pp) tests.push_back({"pp" + std::to_string(n), n, 1, {0}});
  for (int n : plan.tg) tests.push_back({"tg" + std::to_string(n), plan.tg_prompt, n, plan.depths});
  auto fits = [&](const Test& test) {
    int deepest = 0;
    for (int d : test.depths) deepest = std::max(deepest, d == kAutoDepth ? config.shapes.max_draft : d);
    return int64_t{test.prompt_len} + test.gen + deepest + 1 <= limit;
  };
  int planned = 0;
  for (const Test& test : tests) {
    if (fits(test)) planned += static_cast<int>(test.depths.size()) * (1 + plan.repeat);
  }

  json::Array runs;
  int done = 0;
  auto next = [&](const std::string& what) {
    if (hooks.progress) hooks.progress(done, planned, what);
    return !(hooks.should_stop && hooks.should_stop());
  };
  for (const Test& test : tests) {
    if (!fits(test)) {
      std::string why = "does not fit the context of " + std::to_string(limit);
      if (hooks.progress) {
        hooks.progress(done, planned,
                       test.name + ": skipped, " + std::to_string(test.prompt_len) +
                           " prompt + " + std::to_string(test.gen) +
                           " generated tokens do not fit the bundle's context of " +
                           std::to_string(limit));
      }
      runs.push_back(json::Object{{"test", test.name}, {"skipped", why}});
      continue;
    }
    for (int depth : test.depths) {
      if (!next(test.name + " warm-up, depth " + depth_text(depth))) return runs;
      std::vector<int> prompt = prompts.make(test.name + " warm-up " + depth_text(depth), test.prompt_len);
      runs.push_back(measure(target, test.name, depth, -1, prompt, test.gen, nullptr, hooks).record);
      ++done;
    }
    for (int round = 0; round < plan.repeat; ++round) {
      std::vector<int> prompt = prompts.make(test.name + " " + std::to_string(round), test.prompt_len);
      std::optional<std::vector<int>> ar;  // the AR run's tokens on this prompt
      for (int depth : test.depths) {
        if (!next(test.name + " round " + std::to_string(round + 1) + "/" +
                  std::to_string(plan.repeat) + ", depth " + depth_text(depth))) {
          return runs;
        }
        Measured run = measure(target, test.name, depth, round, prompt, test.gen,
                               ar ? &*ar : nullptr, hooks);
        if (depth == 0 && run.tokens) ar = std::move(run.tokens);
        runs.push_back(std::move(run.record));
        ++done;
      }
    }
  }
  if (hooks.progress) hooks.progress(done, planned, "done");
  return runs;
}

}  // namespace

PromptMaker::PromptMaker(int vocab_size, const std::vector<int>& stop_ids, uint64_t seed)
    : seed_(seed) {
  std::set<int> special(stop_ids.begin(), stop_ids.end());
  for (int id = 0; id < vocab_size; ++id) {
    if (special.count(id) == 0) ordinary_.push_back(id);
  }
  if (ordinary_.empty()) ordinary_.push_back(0);
}

std::vector<int> PromptMaker::make(const std::string& run, int length) const {
  PythonRandom random(std::to_string(seed_) + " " + run);
  std::vector<int> ids;
  ids.reserve(static_cast<size_t>(std::max(length, 0)));
  for (int i = 0; i < length; ++i) {
    ids.push_back(ordinary_[random.below(static_cast<uint32_t>(ordinary_.size()))]);
  }
  return ids;
}

std::string prompt_sha256(const std::vector<int>& prompt) {
  return sha256_hex(list_text(prompt)).substr(0, 16);
}

std::string run_bench(BenchTarget& target, const std::string& bundle_dir, const BenchPlan& plan,
                      const MachineInfo& machine, const std::string& command,
                      const std::string& created, const BenchHooks& hooks) {
  check_plan(plan, target.config());
  // read before measuring: a bundle folder without a usable manifest fails in a second
  json::Object bundle = bundle_info(bundle_dir, target.config());
  json::Array runs = run_tests(target, plan, hooks);
  json::Object document = {
      {"schema", kSchema},
      {"created", utf8(created)},
      {"command", utf8(command)},
      {"machine", machine_info(machine)},
      {"bundle", bundle},
      {"plan",
       json::Object{
           {"pp", int_array(plan.pp)},
           {"tg", int_array(plan.tg)},
           {"depths", depths_array(plan.depths)},
           {"repeat", plan.repeat},
           {"tg_prompt", plan.tg_prompt},
           {"acceptance_oracle", nullptr},
           {"seed", static_cast<int64_t>(plan.seed)},
           {"sampling", "greedy"},
       }},
      {"runs", runs},
      {"predictions", nullptr},
  };
  return json::Value(document).dump() + "\n";
}

}  // namespace edgemtp
