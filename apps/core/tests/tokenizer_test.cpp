// Runs edgemtp::Tokenizer on a tokenizer.json and a file of cases and prints what it did as one
// JSON line, so that a test can compare it with Hugging Face `tokenizers`
// (tests/test_apps_tokenizer.py).
//
//   tokenizer_test TOKENIZER.json CASES.json
//   tokenizer_test --self-check
//
// CASES.json: {"encode": [text...], "decode": [[id...]...], "stream": [[id...]...],
// "prompts": [text...], "tokens": [token...]}, every member optional. Printed: per text
// {"with": ids, "without": ids} (encode with and without the special tokens), per id list
// {"skip": text, "keep": text} (decode skipping the special tokens or keeping them), per stream
// {"skip": [piece...], "keep": [piece...]} (Stream::push per id, then finish(), each piece as
// hex of its bytes), per prompt {"plain": ids, "chat": ids} (encode_prompt; an Error as
// {"error": line}), "token_to_id" per token (null: none), "vocab_size", "end_of_turn_id" and
// "encode_seconds" (all encode calls together).
// --self-check: checks that need no oracle (a stream never splits a character, refusals).
//
// Exit 0: printed or checked; 1: the tokenizer.json was refused (its Error line on stderr) or a
// self-check failed; 2: usage or unreadable files.
#include <chrono>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "edgemtp/decode.h"
#include "edgemtp/json.h"
#include "edgemtp/tokenizer.h"

namespace {

using edgemtp::Tokenizer;
using edgemtp::json::Array;
using edgemtp::json::Object;
using edgemtp::json::Value;

bool read_file(const std::string& path, std::string& text) {
  std::ifstream file(path, std::ios::binary);
  if (!file) return false;
  std::ostringstream buffer;
  buffer << file.rdbuf();
  text = buffer.str();
  return true;
}

Value json_ints(const std::vector<int>& values) {
  Array out;
  for (int x : values) out.emplace_back(x);
  return Value(std::move(out));
}

std::vector<int> ints_of(const Value& list) {
  std::vector<int> out;
  for (const Value& x : list.as_array()) out.push_back(x.as_int32());
  return out;
}

std::string hex(const std::string& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (char ch : bytes) {
    const auto byte = static_cast<unsigned char>(ch);
    out += digits[byte >> 4];
    out += digits[byte & 15];
  }
  return out;
}

Value stream_pieces(const Tokenizer& tokenizer, const std::vector<int>& ids, bool skip_special) {
  Tokenizer::Stream stream(tokenizer, skip_special);
  Array pieces;
  for (int id : ids) pieces.emplace_back(hex(stream.push(id)));
  pieces.emplace_back(hex(stream.finish()));
  return Value(std::move(pieces));
}

template <typename Call>
Value ids_or_error(Call call) {
  try {
    return json_ints(call());
  } catch (const edgemtp::Error& e) {
    return Value(Object{{"error", Value(e.what())}});
  }
}

int run_cases(const Tokenizer& tokenizer, const Value& cases) {
  Object out;
  auto member = [&](const char* key) -> const Array& {
    static const Array none;
    const Value* value = cases.find(key);
    return value == nullptr ? none : value->as_array();
  };

  Array encoded;
  std::chrono::duration<double> encode_time{0};
  for (const Value& text : member("encode")) {
    const auto start = std::chrono::steady_clock::now();
    Value with = json_ints(tokenizer.encode(text.as_string(), true));
    Value without = json_ints(tokenizer.encode(text.as_string(), false));
    encode_time += std::chrono::steady_clock::now() - start;
    encoded.emplace_back(Object{{"with", with}, {"without", without}});
  }
  out["encode"] = Value(std::move(encoded));
  out["encode_seconds"] = Value(encode_time.count());

  Array decoded;
  for (const Value& ids : member("decode")) {
    decoded.emplace_back(Object{{"skip", Value(tokenizer.decode(ints_of(ids), true))},
                                {"keep", Value(tokenizer.decode(ints_of(ids), false))}});
  }
  out["decode"] = Value(std::move(decoded));

  Array streams;
  for (const Value& ids : member("stream")) {
    streams.emplace_back(Object{{"skip", stream_pieces(tokenizer, ints_of(ids), true)},
                                {"keep", stream_pieces(tokenizer, ints_of(ids), false)}});
  }
  out["stream"] = Value(std::move(streams));

  Array prompts;
  for (const Value& text : member("prompts")) {
    const std::string& prompt = text.as_string();
    prompts.emplace_back(
        Object{{"plain", ids_or_error([&] { return tokenizer.encode_prompt(prompt, false); })},
               {"chat", ids_or_error([&] { return tokenizer.encode_prompt(prompt, true); })}});
  }
  out["prompts"] = Value(std::move(prompts));

  Object ids;
  for (const Value& token : member("tokens")) {
    const std::optional<int> id = tokenizer.token_to_id(token.as_string());
    ids[token.as_string()] = id ? Value(*id) : Value();
  }
  out["token_to_id"] = Value(std::move(ids));
  out["vocab_size"] = Value(tokenizer.vocab_size());
  const std::optional<int> end_of_turn = tokenizer.end_of_turn_id();
  out["end_of_turn_id"] = end_of_turn ? Value(*end_of_turn) : Value();
  std::cout << Value(std::move(out)).dump() << "\n";
  return 0;
}

// --- self-check ----------------------------------------------------------------------------------

int failures = 0;

void check(bool ok, const std::string& what) {
  if (!ok) {
    std::cerr << "FAIL: " << what << "\n";
    ++failures;
  }
}

bool is_whole_utf8(const std::string& text) {
  for (std::size_t i = 0; i < text.size();) {
    const auto lead = static_cast<unsigned char>(text[i]);
    const std::size_t length = lead < 0x80 ? 1 : lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : 2;
    if (lead >= 0x80 && lead < 0xC2) return false;
    if (i + length > text.size()) return false;
    for (std::size_t n = 1; n < length; ++n) {
      if ((static_cast<unsigned char>(text[i + n]) & 0xC0) != 0x80) return false;
    }
    i += length;
  }
  return true;
}

// A byte-level BPE whose vocabulary is the 256 byte stand-ins (so every multi-byte character is
// split across tokens) plus "<bos>".
std::string byte_level_json() {
  Object vocab;
  int next = 0x100;
  for (int byte = 0; byte < 256; ++byte) {
    const bool printable =
        (byte >= 0x21 && byte <= 0x7E) || (byte >= 0xA1 && byte <= 0xAC) || byte >= 0xAE;
    const int c = printable ? byte : next++;
    std::string utf8;
    if (c < 0x80) {
      utf8 += static_cast<char>(c);
    } else {
      utf8 += static_cast<char>(0xC0 | (c >> 6));
      utf8 += static_cast<char>(0x80 | (c & 0x3F));
    }
    vocab[utf8] = Value(byte);
  }
  vocab["<bos>"] = Value(256);
  Object model{{"type", Value("BPE")}, {"vocab", Value(vocab)}, {"merges", Value(Array{})}};
  Object bos{{"id", Value(256)}, {"content", Value("<bos>")}, {"special", Value(true)},
             {"normalized", Value(false)}};
  Object root{{"model", Value(model)},
              {"added_tokens", Value(Array{Value(bos)})},
              {"pre_tokenizer", Value(Object{{"type", Value("ByteLevel")},
                                             {"add_prefix_space", Value(false)},
                                             {"use_regex", Value(true)}})},
              {"decoder", Value(Object{{"type", Value("ByteLevel")}})}};
  return Value(root).dump();
}

void expect_refusal(const std::string& json_text, const std::string& needle) {
  try {
    Tokenizer::from_json_text(json_text);
    check(false, "accepted a tokenizer.json that has " + needle);
  } catch (const edgemtp::Error& e) {
    const std::string line = e.what();
    check(line.rfind("tokenizer.json: ", 0) == 0 && line.find(needle) != std::string::npos &&
              line.find('\n') == std::string::npos,
          "refusal \"" + line + "\" should name " + needle);
  }
}

int self_check() {
  const Tokenizer tokenizer = Tokenizer::from_json_text(byte_level_json());
  const std::string text = "a\xE2\x82\xAC b\xF0\x9F\x98\x80\xC3\xA9!";  // a€ b😀é!
  const std::vector<int> ids = tokenizer.encode(text, false);
  check(ids.size() == text.size(), "every byte is its own token");
  for (bool skip : {true, false}) {
    Tokenizer::Stream stream(tokenizer, skip);
    std::string joined;
    for (int id : ids) {
      const std::string piece = stream.push(id);
      check(is_whole_utf8(piece), "stream piece " + hex(piece) + " is whole characters");
      joined += piece;
    }
    joined += stream.finish();
    check(joined == text, "the stream's pieces make the text");
  }
  // A character cut short by the end: its bytes come out, as decode gives them, at finish().
  Tokenizer::Stream cut(tokenizer);
  std::string joined;
  for (int id : {int{'x'}, 0xF0, 0x9F, 0x98}) joined += cut.push(id);  // ids are bytes here
  check(joined == "x", "an unfinished character is held back");
  check(joined + cut.finish() == "x\xEF\xBF\xBD", "finish() releases it as decode does");

  check(tokenizer.encode("<bos>a", true) == std::vector<int>{256, 'a'},
        "an inline special token is matched");
  check(tokenizer.decode({256, 'h', 'i'}, true) == "hi", "special tokens are skipped");
  check(tokenizer.decode({256, 'h', 'i'}, false) == "<bos>hi", "or kept");

  expect_refusal("{\"model\": {\"type\": \"WordPiece\", \"vocab\": {}}}", "WordPiece");
  expect_refusal("{\"model\": ", "line 1");
  std::string with_nfc = byte_level_json();
  with_nfc.insert(1, "\"normalizer\": {\"type\": \"NFC\"}, ");
  expect_refusal(with_nfc, "normalizer NFC");
  try {
    tokenizer.encode_prompt("hi", true);
    check(false, "a chat prompt needs turn markers");
  } catch (const edgemtp::Error&) {
  }
  if (failures == 0) std::cout << "tokenizer self-check: ok\n";
  return failures == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && std::string(argv[1]) == "--self-check") return self_check();
  if (argc != 3) {
    std::cerr << "usage: tokenizer_test TOKENIZER.json CASES.json | --self-check\n";
    return 2;
  }
  std::string tokenizer_text, cases_text;
  if (!read_file(argv[1], tokenizer_text) || !read_file(argv[2], cases_text)) {
    std::cerr << "cannot read " << argv[1] << " or " << argv[2] << "\n";
    return 2;
  }
  try {
    const Tokenizer tokenizer = Tokenizer::from_json_text(tokenizer_text);
    return run_cases(tokenizer, Value::parse(cases_text));
  } catch (const edgemtp::Error& e) {
    std::cerr << e.what() << "\n";
    return 1;
  }
}
