// The apps' benchmark mode: `edgemtp bench`'s plan and methodology (runtime/bench.py) over an
// Engine, writing the same JSON (runtime/bench.schema.json, "edgemtp-bench/1") that
// `edgemtp bench collect` reads from a phone.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "edgemtp/engine.h"

namespace edgemtp {

struct BenchPlan {
  std::vector<int> pp{128, 512};  // prompt lengths of the prefill tests
  std::vector<int> tg{128};       // generated tokens of the decode tests
  std::vector<int> depths{0, 1, 2, 3};
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
};

struct BenchHooks {
  // Before each run and after it: the platform's battery reading (nullopt: none).
  std::function<std::optional<BatteryReading>()> battery_before, battery_after;
  // Progress: (runs done, runs planned, a one-line description of the next run).
  std::function<void(int, int, const std::string&)> progress;
  std::function<bool()> should_stop;
};

// Runs the plan (a warm-up per test, flagged and left out of summaries; a fresh prompt per
// round with a run-unique prefix and the cache reset; AR and each depth interleaved on the same
// prompt; greedy MTP tokens checked against AR's; a failed run recorded with its error; a test
// that does not fit the context recorded as skipped) and returns the result document's JSON.
// `command` is the schema's "command" (the app and its settings); `created` its UTC ISO time.
std::string run_bench(Engine& engine, const std::string& bundle_dir, const BenchPlan& plan,
                      const MachineInfo& machine, const std::string& command,
                      const std::string& created, const BenchHooks& hooks = {});

}  // namespace edgemtp
