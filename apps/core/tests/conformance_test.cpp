// Replays conformance vectors written by `edgemtp conformance` through the decode core.
//
//   conformance_test path/to/vectors.json
//
// Every case runs through edgemtp::Decoder over a ReplayModel, which answers each model call
// with the outputs the Python runtime recorded (first token, drafted tokens, the target's
// argmax rows), as logits whose argmax they are, after checking that the call is the recorded
// one (method, positions, padding, token ids). The decoder's record of the generation must
// then equal the vectors' field by field, and its method choice must equal the vectors'
// method_choice tables. The first difference is printed as one line and the program exits 1
// (2: the vectors cannot be read).
#include <cstdint>
#include <deque>
#include <fstream>
#include <iostream>
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

constexpr const char* kFormatName = "edgemtp-conformance";
constexpr int kFormatVersion = 1;

class Mismatch : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

std::vector<int> ints(const Value& v) {
  std::vector<int> out;
  for (const Value& x : v.as_array()) out.push_back(x.as_int32());
  return out;
}

Value json_ints(const std::vector<int>& values) {
  Array out;
  for (int x : values) out.emplace_back(x);
  return Value(std::move(out));
}

std::string ints_text(const std::vector<int>& values) { return json_ints(values).dump(); }

// One model call the recorded engine made, and what the model answered.
struct ExpectedCall {
  std::string method;
  std::vector<int> positions;
  std::vector<int> ids;   // real rows' token ids; a draft step: the token fed
  std::vector<int> answer;  // first token, drafted token, or argmax rows
  int accepted = -1;      // verify: the row the drafter continues from
  std::string where;
};

std::vector<int> positions_of(const Value& call) {
  edgemtp::RowCall row;
  row.start = call["start"].as_int32();
  row.rows = call["rows"].as_int32();
  row.pad = call["pad"].as_int32();
  return row.positions();
}

std::deque<ExpectedCall> expected_calls(const Value& c) {
  std::deque<ExpectedCall> out;
  const std::vector<int> prompt = ints(c["prompt"]);
  const Value& calls = c["prefill"]["calls"];
  for (std::size_t i = 0; i < calls.size(); ++i) {
    const Value& call = calls[i];
    int start = call["start"].as_int32();
    int rows = call["rows"].as_int32();
    if (start < 0 || rows < 0 || start + rows > static_cast<int>(prompt.size())) {
      throw Mismatch("prefill call " + std::to_string(i) + " lies outside the prompt");
    }
    ExpectedCall e;
    e.method = call["method"].as_string();
    e.positions = positions_of(call);
    e.ids.assign(prompt.begin() + start, prompt.begin() + start + rows);
    e.answer = {c["prefill"]["first_token"].as_int32()};
    e.where = "prefill call " + std::to_string(i);
    out.push_back(std::move(e));
  }
  const Value& rounds = c["rounds"];
  for (std::size_t r = 0; r < rounds.size(); ++r) {
    const Value& round = rounds[r];
    std::vector<int> fed{round["input_token"].as_int32()};
    const std::vector<int> drafted = ints(round["drafted"]);
    fed.insert(fed.end(), drafted.begin(), drafted.end());
    const Value& draft_calls = round["draft_calls"];
    if (draft_calls.size() != drafted.size()) {
      throw Mismatch("round " + std::to_string(r) + ": draft_calls and drafted differ in length");
    }
    for (std::size_t i = 0; i < draft_calls.size(); ++i) {
      ExpectedCall e;
      e.method = draft_calls[i]["method"].as_string();
      e.positions = {draft_calls[i]["position"].as_int32()};
      e.ids = {fed[i]};
      e.answer = {drafted[i]};
      e.where = "round " + std::to_string(r) + " draft step " + std::to_string(i);
      out.push_back(std::move(e));
    }
    ExpectedCall e;
    e.method = round["verify"]["method"].as_string();
    e.positions = positions_of(round["verify"]);
    e.ids = fed;
    e.answer = ints(round["target_argmax"]);
    e.accepted = round["accepted"].as_int32();
    e.where = "round " + std::to_string(r) + " verify";
    out.push_back(std::move(e));
  }
  return out;
}

// Answers one case's model calls with the recorded outputs, checking each call first. A
// recorded token becomes a logits row whose first largest entry it is (tied with the next
// token, so that only numpy's first-index argmax reads it back); every other draft step answers
// as a clustered head, over a few candidates and their token ids.
class ReplayModel : public edgemtp::Model {
 public:
  ReplayModel(std::deque<ExpectedCall> expected, int vocab)
      : expected_(std::move(expected)), vocab_(vocab) {}

  bool done() const { return expected_.empty(); }
  const std::string& next_where() const { return expected_.front().where; }

  void prefill_intermediate(const edgemtp::RowCall& call) override {
    take(call.method, call.positions(), call.ids);
  }

  edgemtp::LogitsRow prefill_final(const edgemtp::RowCall& call) override {
    return logits(0, take(call.method, call.positions(), call.ids).answer.at(0));
  }

  std::vector<edgemtp::LogitsRow> verify(const edgemtp::RowCall& call) override {
    ExpectedCall e = take(call.method, call.positions(), call.ids);
    last_accepted_ = e.accepted;
    std::vector<edgemtp::LogitsRow> out;
    for (std::size_t i = 0; i < e.answer.size(); ++i) {
      out.push_back(logits(i, e.answer[i]));
    }
    return out;
  }

  void draft_from_verify_row(int row) override {
    if (row != last_accepted_) {
      throw Mismatch("model call " + std::to_string(made_) +
                     ": the drafter continues from verify row " + std::to_string(row) +
                     ", the recorded round accepted " + std::to_string(last_accepted_));
    }
  }

  edgemtp::DraftLogits draft_step(const std::string& method, int token, int position) override {
    int drafted = take(method, {position}, {token}).answer.at(0);
    if (++draft_steps_ % 2 == 0) return {logits(0, drafted), nullptr};
    candidate_ids_ = {(drafted + 1) % vocab_, drafted, (drafted + 2) % vocab_};
    candidate_logits_ = {-1.0f, 4.0f, 4.0f};
    return {{candidate_logits_.data(), 3}, candidate_ids_.data()};
  }

 private:
  edgemtp::LogitsRow logits(std::size_t row, int token) {
    if (rows_.size() <= row) rows_.resize(row + 1);
    if (token < 0 || token >= vocab_) {
      throw Mismatch("model call " + std::to_string(made_) + ": the recorded token " +
                     std::to_string(token) + " is outside the vocabulary");
    }
    std::vector<float>& r = rows_[row];
    r.assign(static_cast<std::size_t>(vocab_), -3.0f);
    r[static_cast<std::size_t>(token)] = 5.0f;
    if (token + 1 < vocab_) r[static_cast<std::size_t>(token + 1)] = 5.0f;
    return {r.data(), vocab_};
  }

  ExpectedCall take(const std::string& method, const std::vector<int>& positions,
                    const std::vector<int>& ids) {
    if (expected_.empty()) {
      throw Mismatch("model call " + std::to_string(made_) + ": " + method +
                     " called after every recorded call was made");
    }
    ExpectedCall e = std::move(expected_.front());
    expected_.pop_front();
    if (method != e.method || positions != e.positions || ids != e.ids) {
      throw Mismatch("model call " + std::to_string(made_) + ": expected " + e.where + ": " +
                     e.method + " at positions " + ints_text(e.positions) + " with ids " +
                     ints_text(e.ids) + "; got " + method + " at positions " +
                     ints_text(positions) + " with ids " + ints_text(ids));
    }
    ++made_;
    return e;
  }

  std::deque<ExpectedCall> expected_;
  int vocab_;
  int made_ = 0;
  int last_accepted_ = -1;
  int draft_steps_ = 0;
  std::vector<std::vector<float>> rows_;
  std::vector<float> candidate_logits_;
  std::vector<int64_t> candidate_ids_;
};

// --- the decoder's record, in the vectors' shape -------------------------------------------------

Value row_call_json(const edgemtp::RowCall& call) {
  return Value(Object{{"method", Value(call.method)},
                      {"start", Value(call.start)},
                      {"rows", Value(call.rows)},
                      {"pad", Value(call.pad)}});
}

Value round_json(const edgemtp::Round& r, const edgemtp::BundleConfig& config) {
  Array draft_calls;
  for (const edgemtp::DraftCall& d : r.draft_calls) {
    draft_calls.emplace_back(Object{{"method", Value(d.method)}, {"position", Value(d.position)}});
  }
  Array truncates;
  for (const edgemtp::Truncation& t : r.truncates) {
    truncates.emplace_back(Object{{"length", Value(t.length)}, {"keeps", Value(t.keeps)}});
  }
  Object slots;
  for (std::size_t k = 0; k < config.cache_kinds.size(); ++k) {
    slots.emplace(config.cache_kinds[k].name, json_ints(r.slots.at(k)));
  }
  return Value(Object{{"position", Value(r.position)},
                      {"input_token", Value(r.input_token)},
                      {"depth", Value(r.depth)},
                      {"draft_calls", Value(std::move(draft_calls))},
                      {"drafted", json_ints(r.drafted)},
                      {"verify", row_call_json(r.verify)},
                      {"target_argmax", json_ints(r.target_argmax)},
                      {"accepted", Value(r.accepted)},
                      {"committed", json_ints(r.committed)},
                      {"truncates", Value(std::move(truncates))},
                      {"position_after", Value(r.position_after)},
                      {"slots", Value(std::move(slots))}});
}

Value generation_json(const edgemtp::Generation& g, const edgemtp::BundleConfig& config) {
  Array calls;
  for (const edgemtp::RowCall& c : g.prefill_calls) calls.push_back(row_call_json(c));
  Array rounds;
  for (const edgemtp::Round& r : g.rounds) rounds.push_back(round_json(r, config));
  return Value(Object{
      {"prefill", Value(Object{{"calls", Value(std::move(calls))},
                               {"first_token", Value(g.first_token)}})},
      {"rounds", Value(std::move(rounds))},
      {"tokens", json_ints(g.tokens)},
      {"stop_reason", Value(g.stop_reason)}});
}

// Where `got` first differs from `want`, as "path: expected X, got Y"; empty when equal.
std::string first_difference(const Value& want, const Value& got, const std::string& path) {
  if (want.is_object() && got.is_object()) {
    for (const auto& [key, w] : want.as_object()) {
      const Value* g = got.find(key);
      if (g == nullptr) return path + "." + key + ": missing from the decoder's record";
      std::string found = first_difference(w, *g, path + "." + key);
      if (!found.empty()) return found;
    }
    for (const auto& [key, g] : got.as_object()) {
      (void)g;
      if (want.find(key) == nullptr) return path + "." + key + ": not in the vectors";
    }
    return "";
  }
  if (want.is_array() && got.is_array()) {
    std::size_t n = std::min(want.size(), got.size());
    for (std::size_t i = 0; i < n; ++i) {
      std::string found = first_difference(want[i], got[i], path + "[" + std::to_string(i) + "]");
      if (!found.empty()) return found;
    }
    if (want.size() != got.size()) {
      return path + ": expected " + std::to_string(want.size()) + " entries, got " +
             std::to_string(got.size());
    }
    return "";
  }
  if (want != got) return path + ": expected " + want.dump() + ", got " + got.dump();
  return "";
}

// Replays one case; returns its rounds.
std::size_t replay_case(const Value& c, const edgemtp::BundleConfig& config) {
  const std::string name = c["name"].as_string();
  try {
    ReplayModel model(expected_calls(c), config.vocab_size);
    edgemtp::Decoder decoder(config, model);
    edgemtp::FixedDepth policy(c["depth"].as_int32());
    edgemtp::DecodeOptions options;
    options.max_new_tokens = c["max_new_tokens"].as_int32();
    options.stop_ids = ints(c["stop_ids"]);
    edgemtp::Generation g = decoder.generate(ints(c["prompt"]), policy, options);
    if (!model.done()) throw Mismatch("the decoder stopped before " + model.next_where());
    Object recorded;
    for (const char* key : {"prefill", "rounds", "tokens", "stop_reason"}) {
      recorded.emplace(key, c[key]);
    }
    std::string difference = first_difference(Value(std::move(recorded)),
                                               generation_json(g, config), "");
    if (!difference.empty()) throw Mismatch(difference.substr(1));
    return g.rounds.size();
  } catch (const Mismatch& e) {
    throw Mismatch("case '" + name + "': " + e.what());
  } catch (const edgemtp::Error& e) {
    throw Mismatch("case '" + name + "': the decoder failed: " + e.what());
  } catch (const edgemtp::json::TypeError& e) {
    throw Mismatch("case '" + name + "': malformed vectors: " + e.what());
  }
}

std::size_t check_method_choice(const Value& table) {
  const Value& s = table["shapes"];
  edgemtp::Shapes shapes;
  shapes.max_context = s["max_context"].as_int32();
  shapes.max_draft = s["max_draft"].as_int32();
  shapes.chunk = s["chunk"].as_int32();
  shapes.context_buckets = ints(s["context_buckets"]);
  shapes.validate();
  std::string where = "method_choice (max_context " + std::to_string(shapes.max_context) + ")";
  for (const Value& row : table["verify"].as_array()) {
    edgemtp::MethodChoice got =
        shapes.verify_method(row["depth"].as_int32(), row["end"].as_int32());
    if (got.method != row["method"].as_string() || got.pad != row["pad"].as_int32()) {
      throw Mismatch(where + ": verify " + row.dump() + ": got " + got.method + " pad " +
                     std::to_string(got.pad));
    }
  }
  for (const Value& row : table["draft"].as_array()) {
    std::string got = shapes.draft_method(row["position"].as_int32());
    if (got != row["method"].as_string()) {
      throw Mismatch(where + ": draft " + row.dump() + ": got " + got);
    }
  }
  for (const Value& row : table["prefill"].as_array()) {
    std::string got = shapes.prefill_method(row["final"].as_bool(), row["end"].as_int32());
    if (got != row["method"].as_string()) {
      throw Mismatch(where + ": prefill " + row.dump() + ": got " + got);
    }
  }
  return table["verify"].size() + table["draft"].size() + table["prefill"].size();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: conformance_test VECTORS.json (written by edgemtp conformance)\n";
    return 2;
  }
  Value vectors;
  edgemtp::BundleConfig config;
  try {
    std::ifstream file(argv[1], std::ios::binary);
    if (!file) throw std::runtime_error("cannot open the file");
    std::stringstream text;
    text << file.rdbuf();
    vectors = Value::parse(text.str());
    const Value& format = vectors["format"];
    if (format["name"].as_string() != kFormatName ||
        format["version"].as_int() != kFormatVersion) {
      throw std::runtime_error("not " + std::string(kFormatName) + " version " +
                               std::to_string(kFormatVersion) + " vectors");
    }
    config = edgemtp::BundleConfig::from_decode_fields(vectors["manifest"]);
  } catch (const std::exception& e) {
    std::cerr << "conformance: " << argv[1] << ": " << e.what() << "\n";
    return 2;
  }
  try {
    std::size_t cases = 0, rounds = 0, choices = 0;
    for (const Value& c : vectors["cases"].as_array()) {
      rounds += replay_case(c, config);
      ++cases;
    }
    for (const Value& table : vectors["method_choice"].as_array()) {
      choices += check_method_choice(table);
    }
    if (cases == 0) throw Mismatch("the vectors hold no cases");
    std::cout << "conformance: " << cases << " cases, " << rounds << " decode rounds, " << choices
              << " method choices: every decision matches the Python runtime's ("
              << vectors["bundle"]["backend"].as_string() << " bundle, manifest sha256 "
              << vectors["bundle"]["manifest_sha256"].as_string().substr(0, 12) << ")\n";
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "conformance: FAIL: " << e.what() << "\n";
    return 1;
  }
}
