// bench_test: run_bench over a deterministic fake target, and the hashes and prompts it uses,
// for tests/test_apps_bench.py to compare with runtime/bench.py and hashlib.
//
//   bench_test run --bundle DIR [--pp 16,300] [--tg 8] [--depths 0,1,2,auto] [--repeat 2]
//                  [--tg-prompt 12] [--seed 0] [--max-context 256] [--max-draft 3]
//                  [--vocab 500] [--stop-ids 1,2] [--no-drafter] [--fail-calls 3,9]
//                  [--mismatch-depth 2] [--stop-after N] [--battery]
//       prints the result document; progress lines go to stderr.
//   bench_test sha256 FILE | sha512 FILE     prints the hex digest of the file's bytes
//   bench_test prompt SEED RUN LENGTH VOCAB [STOP_IDS]   prints PromptMaker's ids as JSON
//
// The fake's tokens, timings and rounds are functions of the prompt, the options and the
// call's index, written the same way as the Python fake in tests/test_apps_bench.py.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "edgemtp/bench.h"
#include "edgemtp/sha256.h"

namespace {

using edgemtp::Error;

std::vector<int> parse_depths(const std::string& text) {
  std::vector<int> values;
  std::stringstream items(text);
  std::string item;
  while (std::getline(items, item, ',')) {
    if (item == "auto") values.push_back(edgemtp::kAutoDepth);
    else if (!item.empty()) values.push_back(std::stoi(item));
  }
  return values;
}

std::vector<int> parse_ints(const std::string& text) {
  std::vector<int> values;
  std::stringstream items(text);
  std::string item;
  while (std::getline(items, item, ',')) {
    if (!item.empty()) values.push_back(std::stoi(item));
  }
  return values;
}

std::string read_file(const std::string& path) {
  std::FILE* file = std::fopen(path.c_str(), "rb");
  if (file == nullptr) throw Error(path + ": cannot read it");
  std::string bytes;
  char buffer[4096];
  size_t got;
  while ((got = std::fread(buffer, 1, sizeof buffer, file)) > 0) bytes.append(buffer, got);
  std::fclose(file);
  return bytes;
}

class FakeTarget : public edgemtp::BenchTarget {
 public:
  edgemtp::BundleConfig bundle;
  std::set<int> fail_calls;
  int mismatch_depth = -1;  // this depth's last token differs from AR's
  int calls = 0;
  bool reset_since_generate = false;

  const edgemtp::BundleConfig& config() const override { return bundle; }
  std::vector<int> stop_ids() const override { return bundle.eos_token_ids; }
  void reset() override { reset_since_generate = true; }

  edgemtp::GenerateStats generate(const std::vector<int>& prompt,
                                  const edgemtp::GenerateOptions& options) override {
    int call = calls++;
    // what bench.py asks of a run: a fresh cache, greedy, no stop ids; at depth auto
    // (kAutoDepth) the fake drafts (call + round) % (max draft + 1) and times itself as depth 1
    if (!reset_since_generate) throw Error("fake: generate without a reset before it");
    reset_since_generate = false;
    if (!options.sampling.greedy()) throw Error("fake: sampling is not greedy");
    if (options.stop_ids != std::vector<int>{-1}) throw Error("fake: stop ids are not disabled");
    if (fail_calls.count(call)) throw Error("fake runner: call " + std::to_string(call) + " failed");

    int n = options.max_new_tokens;
    const bool autodepth = options.depth == edgemtp::kAutoDepth;
    int depth = autodepth ? 1 : options.depth;
    long long base = 0;
    for (int id : prompt) base += id;
    edgemtp::GenerateStats stats;
    stats.prompt_tokens = static_cast<int>(prompt.size());
    for (int i = 0; i < n; ++i) {
      stats.tokens.push_back(static_cast<int>((base + 7LL * i) % bundle.vocab_size));
    }
    if (!autodepth && depth == mismatch_depth && n > 1) {
      stats.tokens.back() = (stats.tokens.back() + 1) % bundle.vocab_size;
    }
    stats.ttft_s = 0.001 * static_cast<double>(prompt.size()) * (1 + 0.01 * (call % 7));
    stats.decode_s = n > 1 ? 0.01 * (n - 1) / (1 + 0.5 * depth) * (1 + 0.01 * (call % 5)) : 0.0;
    int remaining = n - 1;
    for (int round = 0; remaining > 0; ++round) {
      int wanted = autodepth ? (call + round) % (bundle.shapes.max_draft + 1) : depth;
      int drafted = std::min(wanted, remaining - 1);
      int accepted = (call + round) % (drafted + 1);
      stats.rounds.emplace_back(drafted, accepted);
      remaining -= accepted + 1;
    }
    stats.seconds_by_phase = {
        {"target", stats.decode_s * 0.6},
        {"drafter", depth > 0 ? stats.decode_s * 0.3 : 0.0},
        {"host", stats.decode_s * 0.1},
    };
    stats.stop_reason = "length";
    return stats;
  }
};

int run(const std::vector<std::string>& args) {
  FakeTarget target;
  target.bundle.shapes.max_context = 256;
  target.bundle.shapes.max_draft = 3;
  target.bundle.vocab_size = 500;
  target.bundle.has_drafter = true;
  target.bundle.eos_token_ids = {1, 2};
  target.bundle.backend = "onnx";
  target.bundle.delegate = "cpu";
  edgemtp::BenchPlan plan;
  std::string bundle_dir;
  int stop_after = -1;
  bool battery = false;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& flag = args[i];
    if (flag == "--no-drafter") {
      target.bundle.has_drafter = false;
      continue;
    }
    if (flag == "--battery") {
      battery = true;
      continue;
    }
    if (i + 1 >= args.size()) throw Error(flag + ": needs a value");
    const std::string& value = args[++i];
    if (flag == "--bundle") bundle_dir = value;
    else if (flag == "--pp") plan.pp = parse_ints(value);
    else if (flag == "--tg") plan.tg = parse_ints(value);
    else if (flag == "--depths") plan.depths = parse_depths(value);
    else if (flag == "--repeat") plan.repeat = std::stoi(value);
    else if (flag == "--tg-prompt") plan.tg_prompt = std::stoi(value);
    else if (flag == "--seed") plan.seed = std::stoull(value);
    else if (flag == "--max-context") target.bundle.shapes.max_context = std::stoi(value);
    else if (flag == "--max-draft") target.bundle.shapes.max_draft = std::stoi(value);
    else if (flag == "--vocab") target.bundle.vocab_size = std::stoi(value);
    else if (flag == "--stop-ids") target.bundle.eos_token_ids = parse_ints(value);
    else if (flag == "--fail-calls") {
      for (int call : parse_ints(value)) target.fail_calls.insert(call);
    } else if (flag == "--mismatch-depth") target.mismatch_depth = std::stoi(value);
    else if (flag == "--stop-after") stop_after = std::stoi(value);
    else throw Error(flag + ": unknown flag");
  }
  if (bundle_dir.empty()) throw Error("--bundle DIR is required");

  edgemtp::MachineInfo machine;
  machine.platform = "android";
  machine.device = "Fake Phone";
  machine.cpu = "fake cpu";
  machine.cores = 8;
  machine.memory_gib = 12;
  machine.os = "Android 16";
  machine.threads = 4;
  machine.libraries = {{"executorch", "1.5.1"}, {"onnxruntime", ""}};

  edgemtp::BenchHooks hooks;
  int progress_calls = 0;
  hooks.progress = [&](int done, int planned, const std::string& what) {
    ++progress_calls;
    std::cerr << "progress " << done << "/" << planned << " " << what << "\n";
  };
  if (stop_after >= 0) hooks.should_stop = [&] { return target.calls >= stop_after; };
  if (battery) {
    hooks.battery_before = [&]() -> std::optional<edgemtp::BatteryReading> {
      return edgemtp::BatteryReading{"fake counter", 5000.0 - target.calls, 0, "uAh",
                                     {{"thermal", "nominal"}}};
    };
    hooks.battery_after = [&]() -> std::optional<edgemtp::BatteryReading> {
      return edgemtp::BatteryReading{"fake counter", 0, 4999.5 - target.calls, "uAh",
                                     {{"thermal", "fair"}}};
    };
  }
  std::string document = edgemtp::run_bench(target, bundle_dir, plan, machine,
                                            "bench_test run", "2026-01-02T03:04:05Z", hooks);
  std::cout << document;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  try {
    if (!args.empty() && args[0] == "run") return run({args.begin() + 1, args.end()});
    if (args.size() == 2 && args[0] == "sha256") {
      std::string bytes = read_file(args[1]);
      std::string whole = edgemtp::sha256_hex(bytes);
      // the streaming hash must not depend on how the bytes arrive
      edgemtp::Sha256 pieces;
      for (size_t at = 0, step = 1; at < bytes.size(); at += step, step = step % 67 + 1) {
        pieces.update(bytes.data() + at, std::min(step, bytes.size() - at));
      }
      auto digest = pieces.digest();
      std::string streamed = edgemtp::to_hex(digest.data(), digest.size());
      std::string from_file = edgemtp::sha256_file_hex(args[1]);
      if (streamed != whole || from_file != whole) {
        std::cerr << "sha256 differs: whole " << whole << ", in pieces " << streamed
                  << ", from the file " << from_file << "\n";
        return 1;
      }
      std::cout << whole << "\n";
      return 0;
    }
    if (args.size() == 2 && args[0] == "sha512") {
      auto digest = edgemtp::sha512(read_file(args[1]));
      std::cout << edgemtp::to_hex(digest.data(), digest.size()) << "\n";
      return 0;
    }
    if ((args.size() == 5 || args.size() == 6) && args[0] == "prompt") {
      std::vector<int> stop = args.size() == 6 ? parse_ints(args[5]) : std::vector<int>{};
      edgemtp::PromptMaker prompts(std::stoi(args[4]), stop, std::stoull(args[1]));
      std::vector<int> ids = prompts.make(args[2], std::stoi(args[3]));
      std::string text = "[";
      for (size_t i = 0; i < ids.size(); ++i) text += (i ? ", " : "") + std::to_string(ids[i]);
      std::cout << text << "]\n" << edgemtp::prompt_sha256(ids) << "\n";
      return 0;
    }
  } catch (const std::exception& err) {
    std::cerr << "error: " << err.what() << "\n";
    return 2;
  }
  std::cerr << "usage: bench_test run --bundle DIR [...] | sha256 FILE | sha512 FILE | "
               "prompt SEED RUN LENGTH VOCAB [STOP_IDS]\n";
  return 2;
}
