// Prints what the decode core understood from a bundle's manifest.json, as one JSON line, so
// that a test can compare it with the manifest itself and with the Python side
// (export.static.StaticShapes).
//
//   manifest_test MANIFEST.json [DEPTH:END ...]
//   manifest_test --reads
//
// With a manifest: BundleConfig::from_manifest's fields (backend, delegate, program, schema
// version, shapes, vocabulary, window, stop ids, cache kinds, drafter, the program's methods
// and the ones the decoder needs) and, per round, the methods a round of DEPTH drafts whose last
// row sits at END - 1 calls: its verify method and pad rows, and its draft-step method (null
// without drafts). Without DEPTH:END pairs, every depth the bundle can run at every boundary
// that changes the choice (the first end, each context bucket and the end past it, the context
// end). A pair the bundle cannot run gets an "error" instead of methods.
// With --reads: the manifest schema version and the backends and delegates the core accepts.
//
// Exit 0: printed; 1: the manifest was refused (one line on stderr: the core's reason);
// 2: usage.
#include <algorithm>
#include <fstream>
#include <iostream>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "edgemtp/decode.h"
#include "edgemtp/json.h"

namespace {

using edgemtp::json::Array;
using edgemtp::json::Object;
using edgemtp::json::Value;

struct RoundQuery {
  int depth = 0;
  int end = 0;  // one past the round's last verified row
};

Value json_ints(const std::vector<int>& values) {
  Array out;
  for (int x : values) out.emplace_back(x);
  return Value(std::move(out));
}

Value json_strings(const std::vector<std::string>& values) {
  Array out;
  for (const std::string& s : values) out.emplace_back(s);
  return Value(std::move(out));
}

std::optional<int> parse_int(const std::string& text) {
  if (text.empty() || text.size() > 9) return std::nullopt;
  int value = 0;
  for (char ch : text) {
    if (ch < '0' || ch > '9') return std::nullopt;
    value = value * 10 + (ch - '0');
  }
  return value;
}

std::optional<RoundQuery> parse_query(const std::string& arg) {
  std::size_t colon = arg.find(':');
  if (colon == std::string::npos) return std::nullopt;
  std::optional<int> depth = parse_int(arg.substr(0, colon));
  std::optional<int> end = parse_int(arg.substr(colon + 1));
  if (!depth || !end) return std::nullopt;
  return RoundQuery{*depth, *end};
}

// Every depth the decoder can choose, at each end position where the method choice changes.
std::vector<RoundQuery> boundary_queries(const edgemtp::BundleConfig& config) {
  const edgemtp::Shapes& shapes = config.shapes;
  const int deepest = config.has_drafter ? shapes.max_draft : 0;
  std::vector<RoundQuery> out;
  for (int depth = 0; depth <= deepest; ++depth) {
    std::set<int> ends{depth + 1, shapes.max_context};
    for (int b : shapes.context_buckets) {
      ends.insert(b);
      ends.insert(b + 1);
    }
    for (int end : ends) {
      if (end >= depth + 1 && end <= shapes.max_context) out.push_back({depth, end});
    }
  }
  return out;
}

Value round_json(const edgemtp::BundleConfig& config, const RoundQuery& q) {
  Object row{{"depth", Value(q.depth)}, {"end", Value(q.end)}};
  const edgemtp::Shapes& shapes = config.shapes;
  if (q.end < q.depth + 1 || q.end > shapes.max_context) {
    row["error"] = Value("a round of " + std::to_string(q.depth) + " drafts ending at " +
                         std::to_string(q.end) + " does not fit the context (ends " +
                         std::to_string(q.depth + 1) + ".." + std::to_string(shapes.max_context) +
                         ")");
    return Value(std::move(row));
  }
  row["prefill"] = Value(config.shapes.prefill_method(true, q.end));  // a prompt ending there
  try {
    edgemtp::MethodChoice verify = shapes.verify_method(q.depth, q.end);
    row["verify"] = Value(verify.method);
    row["pad"] = Value(verify.pad);
    // A round's draft steps all sit at its first position: the end minus its rows.
    bool drafts = q.depth > 0 && config.has_drafter;
    row["draft"] = drafts ? Value(shapes.draft_method(q.end - q.depth - 1)) : Value();
  } catch (const edgemtp::Error& e) {
    row["error"] = Value(e.what());
  }
  return Value(std::move(row));
}

Value understanding(const edgemtp::BundleConfig& config, const std::vector<RoundQuery>& queries) {
  Object kinds;
  for (const edgemtp::CacheKind& k : config.cache_kinds) {
    kinds[k.name] = Value(Object{{"slots", Value(k.slots)}, {"trash_slot", Value(k.trash_slot)}});
  }
  Array rounds;
  for (const RoundQuery& q : queries) rounds.push_back(round_json(config, q));
  return Value(Object{
      {"schema_version", Value(config.schema_version)},
      {"backend", Value(config.backend)},
      {"delegate", Value(config.delegate)},
      {"program", Value(config.program)},
      {"max_context", Value(config.shapes.max_context)},
      {"max_draft", Value(config.shapes.max_draft)},
      {"chunk", Value(config.shapes.chunk)},
      {"context_buckets", json_ints(config.shapes.context_buckets)},
      {"vocab_size", Value(config.vocab_size)},
      {"sliding_window", Value(config.sliding_window)},
      {"eos_token_ids", json_ints(config.eos_token_ids)},
      {"cache_kinds", Value(std::move(kinds))},
      {"has_drafter", Value(config.has_drafter)},
      {"methods", json_strings(config.methods)},
      {"required_methods", json_strings(config.required_methods())},
      {"rounds", Value(std::move(rounds))},
  });
}

Value what_the_core_reads() {
  Object backends;
  for (const edgemtp::BackendDelegates& b : edgemtp::supported_backends()) {
    backends[b.backend] = json_strings(b.delegates);
  }
  return Value(Object{{"schema_version", Value(edgemtp::kManifestSchemaVersion)},
                      {"backends", Value(std::move(backends))}});
}

int usage() {
  std::cerr << "usage: manifest_test MANIFEST.json [DEPTH:END ...] | manifest_test --reads\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return usage();
  const std::string first = argv[1];
  if (first == "--reads") {
    if (argc != 2) return usage();
    std::cout << what_the_core_reads().dump() << "\n";
    return 0;
  }
  std::vector<RoundQuery> queries;
  for (int i = 2; i < argc; ++i) {
    std::optional<RoundQuery> q = parse_query(argv[i]);
    if (!q) {
      std::cerr << "manifest_test: '" << argv[i] << "' is not DEPTH:END (e.g. 3:100)\n";
      return usage();
    }
    queries.push_back(*q);
  }
  edgemtp::BundleConfig config;
  try {
    std::ifstream file(first, std::ios::binary);
    if (!file) throw edgemtp::Error("cannot open the file");
    std::stringstream text;
    text << file.rdbuf();
    config = edgemtp::BundleConfig::from_manifest_text(text.str());
  } catch (const edgemtp::Error& e) {
    std::cerr << "manifest_test: " << first << ": " << e.what() << "\n";
    return 1;
  }
  if (queries.empty()) queries = boundary_queries(config);
  std::cout << understanding(config, queries).dump() << "\n";
  return 0;
}
