// The apps' benchmark mode: `edgemtp bench`'s plan and methodology (runtime/bench.py) over an
// Engine, writing the same JSON (runtime/bench.schema.json, "edgemtp-bench/1") that
// `edgemtp bench collect` reads from a phone.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "edgemtp/engine.h"

namespace edgemtp {

// A plan's depth for the adaptive policy (`--mtp auto`): the Engine's AdaptiveDepth, which
// keeps what it learns across the bench's runs; its records say "auto".
inline constexpr int kAutoDepth = -1;

struct BenchPlan {
  std::vector<int> pp{128, 512};  // prompt lengths of the prefill tests
  std::vector<int> tg{128};       // generated tokens of the decode tests
  std::vector<int> depths{0, 1, 2, 3};  // pinned (0 = AR) or kAutoDepth
  int repeat = 5;
  int tg_prompt = 64;  // prompt length of the decode tests
  uint64_t seed = 0;   // of the prompts
};

// What the platform knows of the machine (the schema's "machine" object).
struct MachineInfo {
  std::string platform;  // "android", "ios" or "host"
  std::string device;    // e.g. "Pixel 10 Pro"; empty on a host
  std::string profile;   // the devices/profiles name it matches; empty when none
  std::string cpu;
  int cores = 0;
  double memory_gib = 0;
  std::string os;
  int threads = 1;
  std::vector<std::pair<std::string, std::string>> libraries;  // e.g. {"executorch", "1.5.1"}
};

// Energy over one run where the platform reads it (the schema's per-run "battery" object).
struct BatteryReading {
  std::string source;       // e.g. "BatteryManager.BATTERY_PROPERTY_CHARGE_COUNTER"
  double start = 0, end = 0;
  std::string unit;         // e.g. "uAh", "percent"
  // Other signals the platform reads with it (e.g. {"thermal_state", "fair"}), recorded as
  // strings: "<key>_start" from the reading before the run, "<key>_end" from the one after.
  std::vector<std::pair<std::string, std::string>> extra;
};

struct BenchHooks {
  // Before each run and after it: the platform's battery reading (nullopt: none). The run's
  // "battery" takes source, unit and start from battery_before's reading and end from
  // battery_after's; it is recorded on runs that completed, when both hooks read.
  std::function<std::optional<BatteryReading>()> battery_before, battery_after;
  // Progress: (runs done, runs planned, a one-line description of the next run).
  std::function<void(int, int, const std::string&)> progress;
  std::function<bool()> should_stop;
};

// What run_bench measures: an Engine (run_bench(Engine&) wraps it) or, in tests, a fake.
class BenchTarget {
 public:
  virtual ~BenchTarget() = default;
  virtual const BundleConfig& config() const = 0;
  // The bundle's stop ids (eos, and a chat model's end-of-turn marker): prompts avoid them.
  virtual std::vector<int> stop_ids() const = 0;
  virtual void reset() = 0;  // forget the cache
  virtual GenerateStats generate(const std::vector<int>& prompt, const GenerateOptions& options) = 0;
};

// runtime/bench.py's PromptMaker without prompt texts: seeded random ids that are not stop ids,
// the very ids Python's random.Random(f"{seed} {run}").choice picks, so that an app's prompts
// equal `edgemtp bench`'s for the same bundle and seed.
class PromptMaker {
 public:
  PromptMaker(int vocab_size, const std::vector<int>& stop_ids, uint64_t seed);
  std::vector<int> make(const std::string& run, int length) const;

 private:
  std::vector<int> ordinary_;
  uint64_t seed_;
};

// A run's "prompt_sha256": the first 16 hex digits of sha256(str(prompt)) as Python writes the
// list ("[1, 2, 3]").
std::string prompt_sha256(const std::vector<int>& prompt);

// As run_bench(Engine&, ...) below, over any target. Throws Error (one line) before measuring
// for a plan the bundle cannot run (as BenchPlan.check) or an unreadable manifest.json.
// should_stop is asked before each run; when it says stop, the runs so far are returned.
std::string run_bench(BenchTarget& target, const std::string& bundle_dir, const BenchPlan& plan,
                      const MachineInfo& machine, const std::string& command,
                      const std::string& created, const BenchHooks& hooks = {});

class EngineBenchTarget : public BenchTarget {
 public:
  explicit EngineBenchTarget(Engine& engine) : engine_(engine) {}
  const BundleConfig& config() const override { return engine_.config(); }
  std::vector<int> stop_ids() const override { return engine_.default_stop_ids(); }
  void reset() override { engine_.reset(); }
  GenerateStats generate(const std::vector<int>& prompt, const GenerateOptions& options) override {
    return engine_.generate(prompt, options);
  }

 private:
  Engine& engine_;
};

// Runs the plan (a warm-up per test, flagged and left out of summaries; a fresh prompt per
// round with a run-unique prefix and the cache reset; AR and each depth interleaved on the same
// prompt; greedy MTP tokens checked against AR's; a failed run recorded with its error; a test
// that does not fit the context recorded as skipped) and returns the result document's JSON.
// `command` is the schema's "command" (the app and its settings); `created` its UTC ISO time.
// Inline so that a program that benchmarks only a fake target needs no Engine implementation.
inline std::string run_bench(Engine& engine, const std::string& bundle_dir, const BenchPlan& plan,
                             const MachineInfo& machine, const std::string& command,
                             const std::string& created, const BenchHooks& hooks = {}) {
  EngineBenchTarget target(engine);
  return run_bench(target, bundle_dir, plan, machine, command, created, hooks);
}

}  // namespace edgemtp
