// tokenizer.json for the two kinds our bundles carry: byte-level BPE behind the GPT-2
// pre-tokenizer, and Gemma's SentencePiece-style BPE (spaces as "▁", byte fallback). Each step
// follows the Rust code of Hugging Face `tokenizers` closely enough to give the same ids and the
// same text; anything else a tokenizer.json may hold is refused when it is loaded.
#include "edgemtp/tokenizer.h"

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <queue>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "edgemtp/decode.h"
#include "edgemtp/json.h"
#include "edgemtp/utf8.h"

namespace edgemtp {
namespace {

using json::Value;

[[noreturn]] void refuse(const std::string& why) { throw Error("tokenizer.json: " + why); }

std::string quoted(const std::string& text) { return Value(text).dump(); }

// --- Unicode -------------------------------------------------------------------------------------

struct CodepointRange {
  char32_t first;
  char32_t last;
};

#include "unicode_tables.inc"

template <std::size_t N>
bool in_ranges(const CodepointRange (&ranges)[N], char32_t c) {
  auto after = std::upper_bound(std::begin(ranges), std::end(ranges), c,
                                [](char32_t x, const CodepointRange& r) { return x < r.first; });
  return after != std::begin(ranges) && c <= (after - 1)->last;
}

bool is_letter(char32_t c) {
  if (c < 0x80) return (c | 0x20) >= 'a' && (c | 0x20) <= 'z';
  return in_ranges(kLetterRanges, c);
}

bool is_number(char32_t c) {
  if (c < 0x80) return c >= '0' && c <= '9';
  return in_ranges(kNumberRanges, c);
}

bool is_whitespace(char32_t c) {
  if (c < 0x80) return c == ' ' || (c >= 0x09 && c <= 0x0D);
  return in_ranges(kWhitespaceRanges, c);
}

void replace_all(std::string& text, const std::string& pattern, const std::string& content) {
  if (text.find(pattern) == std::string::npos) return;
  std::string out;
  std::size_t from = 0;
  for (std::size_t at; (at = text.find(pattern, from)) != std::string::npos;) {
    out.append(text, from, at - from);
    out += content;
    from = at + pattern.size();
  }
  out.append(text, from, std::string::npos);
  text = std::move(out);
}

// --- GPT-2 byte-level ----------------------------------------------------------------------------

// GPT-2's printable stand-in for each byte: printable Latin-1 bytes are themselves, the others
// U+0100 onwards in byte order.
struct ByteLevelAlphabet {
  std::array<std::string, 256> byte_chars;
  std::array<int, 0x144> char_bytes;  // -1: not a stand-in

  ByteLevelAlphabet() {
    char_bytes.fill(-1);
    char32_t next = 0x100;
    for (int byte = 0; byte < 256; ++byte) {
      const bool printable =
          (byte >= 0x21 && byte <= 0x7E) || (byte >= 0xA1 && byte <= 0xAC) || byte >= 0xAE;
      const char32_t c = printable ? static_cast<char32_t>(byte) : next++;
      append_utf8(byte_chars[static_cast<std::size_t>(byte)], c);
      char_bytes[c] = byte;
    }
  }
};

const ByteLevelAlphabet& byte_level() {
  static const ByteLevelAlphabet alphabet;
  return alphabet;
}

std::string to_byte_level(std::string_view text) {
  std::string out;
  out.reserve(text.size() * 2);
  for (char ch : text) out += byte_level().byte_chars[static_cast<unsigned char>(ch)];
  return out;
}

// The bytes a token stands for under the ByteLevel decoder: its characters' bytes, or the
// token's own UTF-8 when one character is not a stand-in (an added token such as "\n\n").
void append_byte_level_bytes(std::string& out, const std::string& token) {
  const std::size_t start = out.size();
  for (std::size_t i = 0; i < token.size();) {
    std::size_t length = 0;
    const char32_t c = decode_utf8(token, i, length);
    const int byte = c < byte_level().char_bytes.size() ? byte_level().char_bytes[c] : -1;
    if (byte < 0) {
      out.resize(start);
      out += token;
      return;
    }
    out += static_cast<char>(byte);
    i += length;
  }
}

// The pieces of `text` that the GPT-2 pattern
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// matches one after the other, as a backtracking engine does: at each position the first
// alternative that matches, greedily.
std::vector<std::string_view> split_gpt2(std::string_view text) {
  std::vector<char32_t> chars;
  std::vector<std::size_t> offsets;  // byte offset of each character, then text.size()
  for (std::size_t i = 0; i < text.size();) {
    std::size_t length = 0;
    chars.push_back(decode_utf8(text, i, length));
    offsets.push_back(i);
    i += length;
  }
  offsets.push_back(text.size());

  const std::size_t n = chars.size();
  auto run_end = [&](std::size_t j, auto member) {
    while (j < n && member(chars[j])) ++j;
    return j;
  };
  auto is_other = [](char32_t c) { return !is_whitespace(c) && !is_letter(c) && !is_number(c); };
  auto is_contraction = [&](std::size_t i) -> std::size_t {
    if (chars[i] != '\'' || i + 1 >= n) return 0;
    const char32_t a = chars[i + 1];
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
    const char32_t b = i + 2 < n ? chars[i + 2] : 0;
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
    return 0;
  };

  std::vector<std::string_view> pieces;
  for (std::size_t i = 0; i < n;) {
    std::size_t end = i;
    const std::size_t word = chars[i] == ' ' && i + 1 < n ? i + 1 : i;  // after an optional ' '
    if (std::size_t length = is_contraction(i)) {
      end = i + length;
    } else if (is_letter(chars[word])) {
      end = run_end(word, is_letter);
    } else if (is_number(chars[word])) {
      end = run_end(word, is_number);
    } else if (is_other(chars[word])) {
      end = run_end(word, is_other);
    } else {
      // \s+(?!\S) backs off one character when the run is followed by a non-space; a single
      // space before a non-space is then \s+'s.
      end = run_end(i, is_whitespace);
      if (end < n && end - i >= 2) --end;
    }
    pieces.push_back(text.substr(offsets[i], offsets[end] - offsets[i]));
    i = end;
  }
  return pieces;
}

// --- steps of the pipeline -----------------------------------------------------------------------

struct NormalizerStep {
  enum class Kind { kReplace, kPrepend } kind;
  std::string pattern;
  std::string content;  // the replacement, or the prefix
};

enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

struct PreTokenizerStep {
  enum class Kind { kByteLevel, kSplit } kind;
  bool add_prefix_space = false;  // ByteLevel
  bool use_regex = true;          // ByteLevel
  std::string delimiter = "";     // Split
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
};

struct DecoderStep {
  enum class Kind { kByteLevel, kReplace, kByteFallback, kFuse, kStrip } kind;
  std::string pattern = "";  // Replace
  std::string content = "";  // Replace's replacement, Strip's character
  std::size_t strip = 0;     // Strip: leading characters
};

// `text` split on each occurrence of `delimiter`, as tokenizers' Split pre-tokenizer does with a
// String pattern.
std::vector<std::string_view> split_on(std::string_view text, const std::string& delimiter,
                                       SplitBehavior behavior, bool invert) {
  struct Span {
    std::size_t begin, end;
    bool match;
  };
  std::vector<Span> spans;
  std::size_t from = 0;
  for (std::size_t at; (at = text.find(delimiter, from)) != std::string_view::npos;) {
    if (at != from) spans.push_back({from, at, false});
    spans.push_back({at, at + delimiter.size(), true});
    from = at + delimiter.size();
  }
  if (from != text.size()) spans.push_back({from, text.size(), false});
  if (invert) {
    for (Span& span : spans) span.match = !span.match;
  }

  std::vector<Span> merged;
  bool previous_match = false;
  switch (behavior) {
    case SplitBehavior::kRemoved:
      for (const Span& span : spans) {
        if (!span.match) merged.push_back(span);
      }
      break;
    case SplitBehavior::kIsolated: merged = spans; break;
    case SplitBehavior::kMergedWithPrevious:
      for (const Span& span : spans) {
        if (span.match && !previous_match && !merged.empty()) {
          merged.back().end = span.end;
        } else {
          merged.push_back(span);
        }
        previous_match = span.match;
      }
      break;
    case SplitBehavior::kMergedWithNext:
      for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
        if (it->match && !previous_match && !merged.empty()) {
          merged.back().begin = it->begin;
        } else {
          merged.push_back(*it);
        }
        previous_match = it->match;
      }
      std::reverse(merged.begin(), merged.end());
      break;
    case SplitBehavior::kContiguous:
      for (const Span& span : spans) {
        if (span.match == previous_match && !merged.empty()) {
          merged.back().end = span.end;
        } else {
          merged.push_back(span);
        }
        previous_match = span.match;
      }
      break;
  }
  std::vector<std::string_view> pieces;
  for (const Span& span : merged) pieces.push_back(text.substr(span.begin, span.end - span.begin));
  return pieces;
}

// The added tokens' texts in a byte trie, matched leftmost-longest (the aho-corasick match kind
// tokenizers uses).
class TokenMatcher {
 public:
  struct Match {
    std::size_t begin, end;
    int token;
  };

  void add(const std::string& pattern, int token) {
    if (pattern.empty()) return;
    int node = 0;
    for (char ch : pattern) {
      auto [it, added] = children_.try_emplace(edge(node, ch), static_cast<int>(tokens_.size()));
      if (added) tokens_.push_back(-1);
      node = it->second;
    }
    if (tokens_[static_cast<std::size_t>(node)] < 0) tokens_[static_cast<std::size_t>(node)] = token;
  }

  std::vector<Match> find_all(std::string_view text) const {
    std::vector<Match> matches;
    if (children_.empty()) return matches;
    for (std::size_t begin = 0; begin < text.size();) {
      Match longest{begin, begin, -1};
      int node = 0;
      for (std::size_t i = begin; i < text.size(); ++i) {
        auto it = children_.find(edge(node, text[i]));
        if (it == children_.end()) break;
        node = it->second;
        if (tokens_[static_cast<std::size_t>(node)] >= 0) {
          longest = {begin, i + 1, tokens_[static_cast<std::size_t>(node)]};
        }
      }
      if (longest.token >= 0) {
        matches.push_back(longest);
        begin = longest.end;
      } else {
        ++begin;
      }
    }
    return matches;
  }

 private:
  static std::uint64_t edge(int node, char ch) {
    return static_cast<std::uint64_t>(node) << 8 | static_cast<unsigned char>(ch);
  }

  std::unordered_map<std::uint64_t, int> children_;
  std::vector<int> tokens_{-1};  // per node (the root first): the token ending there, or -1
};

// The BPE model: characters to vocabulary ids, then merges by rank.
struct Bpe {
  struct Merge {
    std::uint32_t rank;
    int id;  // the merged token
  };

  std::unordered_map<std::string, int> vocab;
  std::vector<std::string> tokens;  // by id; ids absent from the vocabulary are not `present`
  std::vector<bool> present;
  std::unordered_map<std::uint64_t, Merge> merges;  // by pair_key(left, right)
  std::optional<std::string> unk_token;
  bool fuse_unk = false;
  bool byte_fallback = false;
  bool ignore_merges = false;
  std::array<int, 256> byte_ids{};  // "<0xNN>"'s id, or -1

  static std::uint64_t pair_key(int left, int right) {
    return static_cast<std::uint64_t>(static_cast<std::uint32_t>(left)) << 32 |
           static_cast<std::uint32_t>(right);
  }

  std::optional<int> find(const std::string& token) const {
    auto it = vocab.find(token);
    if (it == vocab.end()) return std::nullopt;
    return it->second;
  }

  const Merge* merge_of(int left, int right) const {
    auto it = merges.find(pair_key(left, right));
    return it == merges.end() ? nullptr : &it->second;
  }

  void tokenize(std::string_view word, std::vector<int>& out) const;
  void merge_all(std::vector<int>& ids) const;
};

void Bpe::tokenize(std::string_view word, std::vector<int>& out) const {
  if (word.empty()) return;
  if (ignore_merges) {
    if (std::optional<int> id = find(std::string(word))) {
      out.push_back(*id);
      return;
    }
  }
  std::vector<int> ids;
  std::optional<int> pending_unk;
  auto unk_id = [&] {
    std::optional<int> id = find(*unk_token);
    if (!id) refuse("unk_token " + quoted(*unk_token) + " is not in the vocabulary");
    return *id;
  };
  for (std::size_t i = 0; i < word.size();) {
    std::size_t length = 0;
    decode_utf8(word, i, length);
    const std::string piece(word.substr(i, length));
    i += length;
    if (std::optional<int> id = find(piece)) {
      if (pending_unk) ids.push_back(*pending_unk);
      pending_unk.reset();
      ids.push_back(*id);
      continue;
    }
    if (byte_fallback &&
        std::all_of(piece.begin(), piece.end(),
                    [&](char ch) { return byte_ids[static_cast<unsigned char>(ch)] >= 0; })) {
      // As tokenizers does, a pending unknown is not flushed before the bytes.
      for (char ch : piece) ids.push_back(byte_ids[static_cast<unsigned char>(ch)]);
      continue;
    }
    if (!unk_token) continue;  // no unknown token: the character is dropped
    if (pending_unk && !fuse_unk) ids.push_back(*pending_unk);
    pending_unk = unk_id();
  }
  if (pending_unk) ids.push_back(*pending_unk);
  merge_all(ids);
  out.insert(out.end(), ids.begin(), ids.end());
}

// tokenizers' Word::merge_all: the lowest-ranked mergeable pair first, the leftmost among equal
// ranks, through a heap whose stale entries are dropped when popped.
void Bpe::merge_all(std::vector<int>& ids) const {
  struct Symbol {
    int id;
    int prev, next;  // -1: none
    bool removed;
  };
  struct Candidate {
    std::uint32_t rank;
    int pos;
    int id;
  };
  struct Later {
    bool operator()(const Candidate& a, const Candidate& b) const {
      return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
    }
  };

  const int n = static_cast<int>(ids.size());
  std::vector<Symbol> symbols;
  symbols.reserve(ids.size());
  std::vector<Candidate> initial;
  for (int i = 0; i < n; ++i) {
    symbols.push_back({ids[static_cast<std::size_t>(i)], i - 1, i + 1 < n ? i + 1 : -1, false});
    if (i + 1 < n) {
      if (const Merge* m = merge_of(ids[static_cast<std::size_t>(i)],
                                    ids[static_cast<std::size_t>(i + 1)])) {
        initial.push_back({m->rank, i, m->id});
      }
    }
  }
  std::priority_queue<Candidate, std::vector<Candidate>, Later> queue(Later{}, std::move(initial));

  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& left = symbols[static_cast<std::size_t>(top.pos)];
    if (left.removed || left.next < 0) continue;
    Symbol& right = symbols[static_cast<std::size_t>(left.next)];
    const Merge* current = merge_of(left.id, right.id);
    if (current == nullptr || current->id != top.id) continue;  // stale

    left.id = top.id;
    left.next = right.next;
    right.removed = true;
    if (left.next >= 0) symbols[static_cast<std::size_t>(left.next)].prev = top.pos;
    if (left.prev >= 0) {
      if (const Merge* m = merge_of(symbols[static_cast<std::size_t>(left.prev)].id, left.id)) {
        queue.push({m->rank, left.prev, m->id});
      }
    }
    if (left.next >= 0) {
      if (const Merge* m = merge_of(left.id, symbols[static_cast<std::size_t>(left.next)].id)) {
        queue.push({m->rank, top.pos, m->id});
      }
    }
  }
  ids.clear();
  for (const Symbol& symbol : symbols) {
    if (!symbol.removed) ids.push_back(symbol.id);
  }
}

struct AddedToken {
  int id = 0;
  std::string content;
  std::string text;  // what decoding sees: a normalized token's content normalized, as tokenizers
                     // 0.23 does (so a special one that normalizing changes is not skipped)
  bool special = false;
  bool normalized = false;
  bool lstrip = false;
  bool rstrip = false;
};

// A ByteFallback decoder's byte token "<0xNN>": its byte, or -1.
int fallback_byte(const std::string& token) {
  if (token.size() != 6 || token.compare(0, 3, "<0x") != 0 || token[5] != '>') return -1;
  auto digit = [](char ch) {
    if (ch >= '0' && ch <= '9') return ch - '0';
    if (ch >= 'a' && ch <= 'f') return ch - 'a' + 10;
    if (ch >= 'A' && ch <= 'F') return ch - 'A' + 10;
    return -1;
  };
  const int high = token[3] == '+' ? 0 : digit(token[3]);  // Rust's from_str_radix takes a '+'
  const int low = digit(token[4]);
  return high < 0 || low < 0 ? -1 : high * 16 + low;
}

// --- reading tokenizer.json ----------------------------------------------------------------------

// Runs one section's reader, naming the section in a malformed-JSON refusal.
template <typename Read>
void read_section(const char* name, Read read) {
  try {
    read();
  } catch (const json::TypeError& e) {
    refuse(std::string(name) + ": " + e.what());
  }
}

bool flag(const Value& object, const char* key, bool fallback) {
  const Value* value = object.find(key);
  return value == nullptr || value->is_null() ? fallback : value->as_bool();
}

std::string type_of(const Value& object, const std::string& what) {
  if (!object.is_object()) refuse(what + " is not an object");
  const Value* type = object.find("type");
  if (type == nullptr || !type->is_string()) refuse(what + " has no type");
  return type->as_string();
}

// A {"String": s} pattern; a Regex pattern is refused.
std::string string_pattern(const Value& pattern, const std::string& what) {
  if (const Value* text = pattern.find("String")) {
    if (text->as_string().empty()) refuse(what + " with an empty pattern is not supported");
    return text->as_string();
  }
  if (pattern.find("Regex") != nullptr) {
    refuse(what + " with a Regex pattern is not supported (only String patterns)");
  }
  refuse(what + " has no String pattern");
}

}  // namespace

struct Tokenizer::Impl {
  Bpe model;
  std::vector<AddedToken> added;
  std::unordered_map<std::string, int> added_ids;  // content -> id
  std::unordered_map<int, std::size_t> added_by_id;  // id -> index in `added`
  std::unordered_set<std::string> special_contents;
  TokenMatcher raw_tokens;         // added tokens matched before normalization
  TokenMatcher normalized_tokens;  // added tokens matched in the normalized text
  std::vector<NormalizerStep> normalizer;
  std::vector<PreTokenizerStep> pre_tokenizer;
  bool has_decoder = false;
  std::vector<DecoderStep> decoder;
  bool has_template = false;
  std::vector<std::vector<int>> template_ids;  // per template item: its ids; empty: the text
  std::optional<std::pair<std::string, std::string>> turn;  // start and end markers

  void read_added_tokens(const Value& tokens);
  void read_model(const Value& model);
  void read_normalizer(const Value& step);
  void read_pre_tokenizer(const Value& step);
  void read_decoder(const Value& step);
  void read_post_processor(const Value& step);

  std::string normalize(std::string_view text) const;
  std::vector<std::string> pre_tokenize(std::string_view text) const;
  struct Piece {
    std::string_view text;
    int token;  // index into `added`, or -1 for text
  };
  std::vector<Piece> split_added(std::string_view text, const TokenMatcher& matcher) const;
  std::vector<int> encode(std::string_view text, bool add_special) const;

  std::optional<int> token_to_id(std::string_view token) const;
  const std::string* token_of(int id) const;
  std::vector<std::string> tokens_of(const int* ids, std::size_t count, bool skip_special) const;
  // The decoder on `tokens`; `continuation`: they follow tokens already decoded, so what the
  // decoder does only at the start of the text (strip a leading space) is not done again.
  std::string decode_tokens(std::vector<std::string> tokens, bool continuation) const;
  // How many leading ids decode to text that no later id can change.
  std::size_t settled_ids(const std::vector<int>& ids, bool skip_special) const;
  bool decoder_has(DecoderStep::Kind kind) const {
    return std::any_of(decoder.begin(), decoder.end(),
                       [&](const DecoderStep& step) { return step.kind == kind; });
  }
};

void Tokenizer::Impl::read_added_tokens(const Value& tokens) {
  for (const Value& token : tokens.as_array()) {
    AddedToken t;
    t.id = token["id"].as_int32();
    t.content = token["content"].as_string();
    t.special = flag(token, "special", false);
    t.normalized = flag(token, "normalized", !t.special);
    t.lstrip = flag(token, "lstrip", false);
    t.rstrip = flag(token, "rstrip", false);
    if (flag(token, "single_word", false)) {
      refuse("added token " + quoted(t.content) + " with single_word is not supported");
    }
    if (t.id < 0) refuse("added token " + quoted(t.content) + " has a negative id");
    added_ids.emplace(t.content, t.id);
    added_by_id.emplace(t.id, added.size());
    if (t.special) special_contents.insert(t.content);
    added.push_back(std::move(t));
  }
}

void Tokenizer::Impl::read_model(const Value& json_model) {
  const std::string type = type_of(json_model, "model");
  if (type != "BPE") refuse("model type " + type + " is not supported (only BPE)");
  const Value* dropout = json_model.find("dropout");
  if (dropout != nullptr && !dropout->is_null() && dropout->as_number() != 0.0) {
    refuse("BPE dropout is not supported");
  }
  for (const char* affix : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    const Value* value = json_model.find(affix);
    if (value != nullptr && !value->is_null() && !value->as_string().empty()) {
      refuse(std::string("BPE ") + affix + " is not supported");
    }
  }
  if (const Value* unk = json_model.find("unk_token"); unk != nullptr && !unk->is_null()) {
    model.unk_token = unk->as_string();
  }
  model.fuse_unk = flag(json_model, "fuse_unk", false);
  model.byte_fallback = flag(json_model, "byte_fallback", false);
  model.ignore_merges = flag(json_model, "ignore_merges", false);

  constexpr int kMaxId = 1 << 24;
  for (const auto& [token, json_id] : json_model["vocab"].as_object()) {
    const int id = json_id.as_int32();
    if (id < 0 || id >= kMaxId) refuse("vocabulary id " + std::to_string(id) + " is out of range");
    model.vocab.emplace(token, id);
    if (static_cast<std::size_t>(id) >= model.tokens.size()) {
      model.tokens.resize(static_cast<std::size_t>(id) + 1);
      model.present.resize(static_cast<std::size_t>(id) + 1);
    }
    model.tokens[static_cast<std::size_t>(id)] = token;
    model.present[static_cast<std::size_t>(id)] = true;
  }
  for (int byte = 0; byte < 256; ++byte) {
    static const char* hex = "0123456789ABCDEF";
    const std::string name = std::string("<0x") + hex[byte >> 4] + hex[byte & 15] + ">";
    model.byte_ids[static_cast<std::size_t>(byte)] = model.find(name).value_or(-1);
  }

  std::uint32_t rank = 0;
  for (const Value& merge : json_model["merges"].as_array()) {
    std::string left, right;
    if (merge.is_string()) {  // the older "left right" form
      const std::string& line = merge.as_string();
      if (line.rfind("#version", 0) == 0) continue;
      const std::size_t space = line.find(' ');
      if (space == std::string::npos || line.find(' ', space + 1) != std::string::npos) {
        refuse("merge " + quoted(line) + " is not two tokens");
      }
      left = line.substr(0, space);
      right = line.substr(space + 1);
    } else {
      if (merge.size() != 2) refuse("merge " + merge.dump() + " is not two tokens");
      left = merge[0].as_string();
      right = merge[1].as_string();
    }
    const std::optional<int> left_id = model.find(left), right_id = model.find(right),
                             merged_id = model.find(left + right);
    if (!left_id || !right_id || !merged_id) {
      refuse("merge " + quoted(left + " " + right) + " uses a token not in the vocabulary");
    }
    model.merges[Bpe::pair_key(*left_id, *right_id)] = {rank++, *merged_id};  // the last wins
  }
}

void Tokenizer::Impl::read_normalizer(const Value& step) {
  if (step.is_null()) return;
  const std::string type = type_of(step, "normalizer");
  if (type == "Sequence") {
    for (const Value& inner : step["normalizers"].as_array()) read_normalizer(inner);
  } else if (type == "Replace") {
    normalizer.push_back({NormalizerStep::Kind::kReplace,
                          string_pattern(step["pattern"], "normalizer Replace"),
                          step["content"].as_string()});
  } else if (type == "Prepend") {
    normalizer.push_back({NormalizerStep::Kind::kPrepend, "", step["prepend"].as_string()});
  } else {
    refuse("normalizer " + type + " is not supported (only Replace, Prepend and Sequence)");
  }
}

void Tokenizer::Impl::read_pre_tokenizer(const Value& step) {
  if (step.is_null()) return;
  const std::string type = type_of(step, "pre_tokenizer");
  if (type == "Sequence") {
    for (const Value& inner : step["pretokenizers"].as_array()) read_pre_tokenizer(inner);
  } else if (type == "ByteLevel") {
    PreTokenizerStep byte_level_step{PreTokenizerStep::Kind::kByteLevel};
    byte_level_step.add_prefix_space = flag(step, "add_prefix_space", true);
    byte_level_step.use_regex = flag(step, "use_regex", true);
    pre_tokenizer.push_back(byte_level_step);
  } else if (type == "Split") {
    PreTokenizerStep split{PreTokenizerStep::Kind::kSplit};
    split.delimiter = string_pattern(step["pattern"], "pre_tokenizer Split");
    const std::string& behavior = step["behavior"].as_string();
    if (behavior == "Removed") {
      split.behavior = SplitBehavior::kRemoved;
    } else if (behavior == "Isolated") {
      split.behavior = SplitBehavior::kIsolated;
    } else if (behavior == "MergedWithPrevious") {
      split.behavior = SplitBehavior::kMergedWithPrevious;
    } else if (behavior == "MergedWithNext") {
      split.behavior = SplitBehavior::kMergedWithNext;
    } else if (behavior == "Contiguous") {
      split.behavior = SplitBehavior::kContiguous;
    } else {
      refuse("pre_tokenizer Split behavior " + behavior + " is not supported");
    }
    split.invert = flag(step, "invert", false);
    pre_tokenizer.push_back(split);
  } else {
    refuse("pre_tokenizer " + type + " is not supported (only ByteLevel, Split and Sequence)");
  }
}

void Tokenizer::Impl::read_decoder(const Value& step) {
  if (step.is_null()) return;
  has_decoder = true;
  const std::string type = type_of(step, "decoder");
  if (type == "Sequence") {
    for (const Value& inner : step["decoders"].as_array()) read_decoder(inner);
  } else if (type == "ByteLevel") {
    decoder.push_back({DecoderStep::Kind::kByteLevel});
  } else if (type == "Replace") {
    decoder.push_back({DecoderStep::Kind::kReplace,
                       string_pattern(step["pattern"], "decoder Replace"),
                       step["content"].as_string()});
  } else if (type == "ByteFallback") {
    decoder.push_back({DecoderStep::Kind::kByteFallback});
  } else if (type == "Fuse") {
    decoder.push_back({DecoderStep::Kind::kFuse});
  } else if (type == "Strip") {
    const std::string& content = step["content"].as_string();
    if (utf8_length(content) != 1) refuse("decoder Strip's content is not one character");
    if (step["stop"].as_int() != 0) refuse("decoder Strip with stop > 0 is not supported");
    const std::int64_t start = step["start"].as_int();
    if (start < 0) refuse("decoder Strip's start is negative");
    decoder.push_back(
        {DecoderStep::Kind::kStrip, "", content, static_cast<std::size_t>(start)});
  } else {
    refuse("decoder " + type +
           " is not supported (only ByteLevel, Replace, ByteFallback, Fuse, Strip and Sequence)");
  }
}

void Tokenizer::Impl::read_post_processor(const Value& step) {
  if (step.is_null()) return;
  const std::string type = type_of(step, "post_processor");
  if (type == "Sequence") {
    for (const Value& inner : step["processors"].as_array()) read_post_processor(inner);
  } else if (type == "ByteLevel") {
    // Only trims offsets: no ids change.
  } else if (type == "TemplateProcessing") {
    if (has_template) refuse("post_processor with two TemplateProcessing is not supported");
    has_template = true;
    const Value& specials = step["special_tokens"];
    for (const Value& item : step["single"].as_array()) {
      if (const Value* sequence = item.find("Sequence")) {
        if ((*sequence)["id"].as_string() != "A") {
          refuse("post_processor TemplateProcessing's single template uses sequence " +
                 (*sequence)["id"].as_string());
        }
        template_ids.emplace_back();
      } else {
        const std::string& name = item["SpecialToken"]["id"].as_string();
        const Value* special = specials.find(name);
        if (special == nullptr) refuse("post_processor names an unknown token " + quoted(name));
        std::vector<int> ids;
        for (const Value& id : (*special)["ids"].as_array()) ids.push_back(id.as_int32());
        if (ids.empty()) refuse("post_processor token " + quoted(name) + " has no ids");
        template_ids.push_back(std::move(ids));
      }
    }
  } else {
    refuse("post_processor " + type +
           " is not supported (only TemplateProcessing, ByteLevel and Sequence)");
  }
}

std::string Tokenizer::Impl::normalize(std::string_view text) const {
  std::string out(text);
  for (const NormalizerStep& step : normalizer) {
    if (step.kind == NormalizerStep::Kind::kReplace) {
      replace_all(out, step.pattern, step.content);
    } else if (!out.empty()) {
      out.insert(0, step.content);
    }
  }
  return out;
}

std::vector<std::string> Tokenizer::Impl::pre_tokenize(std::string_view text) const {
  std::vector<std::string> words{std::string(text)};
  for (const PreTokenizerStep& step : pre_tokenizer) {
    std::vector<std::string> next;
    for (const std::string& word : words) {
      if (step.kind == PreTokenizerStep::Kind::kSplit) {
        for (std::string_view piece : split_on(word, step.delimiter, step.behavior, step.invert)) {
          if (!piece.empty()) next.emplace_back(piece);
        }
        continue;
      }
      const std::string prefixed =
          step.add_prefix_space && word.rfind(' ', 0) != 0 ? " " + word : word;
      if (!step.use_regex) {
        next.push_back(to_byte_level(prefixed));
        continue;
      }
      for (std::string_view piece : split_gpt2(prefixed)) next.push_back(to_byte_level(piece));
    }
    words = std::move(next);
  }
  words.erase(std::remove_if(words.begin(), words.end(),
                             [](const std::string& word) { return word.empty(); }),
              words.end());
  return words;
}

std::vector<Tokenizer::Impl::Piece> Tokenizer::Impl::split_added(
    std::string_view text, const TokenMatcher& matcher) const {
  std::vector<Piece> pieces;
  std::size_t done = 0;  // text before this is in `pieces`
  for (const TokenMatcher::Match& match : matcher.find_all(text)) {
    const AddedToken& token = added[static_cast<std::size_t>(match.token)];
    std::size_t begin = match.begin, end = match.end;
    if (token.lstrip) {  // take the whitespace before it, unless a token already took it
      std::size_t start = begin;
      while (start > 0) {
        std::size_t previous = start - 1;
        while (previous > 0 && (static_cast<unsigned char>(text[previous]) & 0xC0) == 0x80) {
          --previous;
        }
        std::size_t length = 0;
        if (!is_whitespace(decode_utf8(text, previous, length))) break;
        start = previous;
      }
      begin = std::max(start, done);
    }
    if (token.rstrip) {
      while (end < text.size()) {
        std::size_t length = 0;
        if (!is_whitespace(decode_utf8(text, end, length))) break;
        end += length;
      }
    }
    if (done < begin) pieces.push_back({text.substr(done, begin - done), -1});
    pieces.push_back({text.substr(begin, end - begin), match.token});
    done = end;
  }
  if (done < text.size()) pieces.push_back({text.substr(done), -1});
  return pieces;
}

std::vector<int> Tokenizer::Impl::encode(std::string_view text, bool add_special) const {
  if (!is_valid_utf8(text)) throw Error("tokenizer: the text is not valid UTF-8");
  std::vector<int> ids;
  for (const Piece& raw : split_added(text, raw_tokens)) {
    if (raw.token >= 0) {
      ids.push_back(added[static_cast<std::size_t>(raw.token)].id);
      continue;
    }
    const std::string normalized = normalize(raw.text);
    for (const Piece& piece : split_added(normalized, normalized_tokens)) {
      if (piece.token >= 0) {
        ids.push_back(added[static_cast<std::size_t>(piece.token)].id);
        continue;
      }
      for (const std::string& word : pre_tokenize(piece.text)) model.tokenize(word, ids);
    }
  }
  if (!add_special || !has_template) return ids;
  std::vector<int> framed;
  for (const std::vector<int>& item : template_ids) {
    const std::vector<int>& part = item.empty() ? ids : item;
    framed.insert(framed.end(), part.begin(), part.end());
  }
  return framed;
}

std::optional<int> Tokenizer::Impl::token_to_id(std::string_view token) const {
  const std::string key(token);
  auto it = added_ids.find(key);
  if (it != added_ids.end()) return it->second;
  return model.find(key);
}

const std::string* Tokenizer::Impl::token_of(int id) const {
  auto it = added_by_id.find(id);
  if (it != added_by_id.end()) return &added[it->second].text;
  if (id >= 0 && static_cast<std::size_t>(id) < model.tokens.size() &&
      model.present[static_cast<std::size_t>(id)]) {
    return &model.tokens[static_cast<std::size_t>(id)];
  }
  return nullptr;  // unknown ids are skipped, as tokenizers does
}

std::vector<std::string> Tokenizer::Impl::tokens_of(const int* ids, std::size_t count,
                                                    bool skip_special) const {
  std::vector<std::string> tokens;
  for (std::size_t i = 0; i < count; ++i) {
    const std::string* token = token_of(ids[i]);
    if (token == nullptr || (skip_special && special_contents.count(*token) > 0)) continue;
    tokens.push_back(*token);
  }
  return tokens;
}

std::string Tokenizer::Impl::decode_tokens(std::vector<std::string> tokens,
                                           bool continuation) const {
  std::string text;
  if (!has_decoder) {  // tokenizers joins the tokens with spaces
    for (const std::string& token : tokens) {
      if (continuation || !text.empty()) text += ' ';
      text += token;
    }
    return text;
  }
  bool fused = false;  // the tokens are one text now
  for (const DecoderStep& step : decoder) {
    switch (step.kind) {
      case DecoderStep::Kind::kByteLevel: {
        std::string bytes;
        for (const std::string& token : tokens) append_byte_level_bytes(bytes, token);
        tokens = {lossy_utf8(bytes)};
        fused = true;
        break;
      }
      case DecoderStep::Kind::kReplace:
        for (std::string& token : tokens) replace_all(token, step.pattern, step.content);
        break;
      case DecoderStep::Kind::kByteFallback: {
        // A run of byte tokens is its UTF-8 text, or one U+FFFD per byte when ill-formed.
        std::vector<std::string> out;
        std::string run;
        std::size_t run_length = 0;
        auto flush = [&] {
          if (run_length == 0) return;
          if (is_valid_utf8(run)) {
            out.push_back(run);
          } else {
            for (std::size_t i = 0; i < run_length; ++i) out.emplace_back(kReplacementCharacter);
          }
          run.clear();
          run_length = 0;
        };
        for (std::string& token : tokens) {
          const int byte = fallback_byte(token);
          if (byte >= 0) {
            run += static_cast<char>(byte);
            ++run_length;
          } else {
            flush();
            out.push_back(std::move(token));
          }
        }
        flush();
        tokens = std::move(out);
        break;
      }
      case DecoderStep::Kind::kFuse: {
        std::string joined;
        for (const std::string& token : tokens) joined += token;
        tokens = {joined};
        fused = true;
        break;
      }
      case DecoderStep::Kind::kStrip:
        if (continuation && fused) break;  // the start of the text was stripped before
        for (std::string& token : tokens) {
          std::size_t cut = 0;
          for (std::size_t i = 0; i < step.strip; ++i) {
            if (token.compare(cut, step.content.size(), step.content) != 0) break;
            cut += step.content.size();
          }
          token.erase(0, cut);
        }
        break;
    }
  }
  for (const std::string& token : tokens) text += token;
  return text;
}

std::size_t Tokenizer::Impl::settled_ids(const std::vector<int>& ids, bool skip_special) const {
  std::vector<const std::string*> tokens;
  std::vector<std::size_t> positions;  // each token's index in ids
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const std::string* token = token_of(ids[i]);
    if (token == nullptr || (skip_special && special_contents.count(*token) > 0)) continue;
    tokens.push_back(token);
    positions.push_back(i);
  }
  std::size_t settled = tokens.size();
  if (decoder_has(DecoderStep::Kind::kByteFallback)) {
    // A run of byte tokens turns into U+FFFDs as a whole when a later byte makes it ill-formed.
    while (settled > 0 && fallback_byte(*tokens[settled - 1]) >= 0) --settled;
  }
  if (decoder_has(DecoderStep::Kind::kByteLevel)) {
    // Hold back the tokens from where a character still lacks bytes.
    std::string bytes;
    std::vector<std::size_t> ends;
    for (std::size_t t = 0; t < settled; ++t) {
      append_byte_level_bytes(bytes, *tokens[t]);
      ends.push_back(bytes.size());
    }
    const std::size_t tail = truncated_tail(bytes);
    while (settled > 0 && ends[settled - 1] > tail) --settled;
  }
  return settled == tokens.size() ? ids.size() : positions[settled];
}

// --- Tokenizer -----------------------------------------------------------------------------------

Tokenizer Tokenizer::from_json_text(std::string_view text) {
  Value root;
  try {
    root = Value::parse(text);
  } catch (const json::ParseError& e) {
    refuse(e.what());
  }
  if (!root.is_object()) refuse("not a JSON object");
  auto impl = std::make_unique<Impl>();
  for (const char* unsupported : {"truncation", "padding"}) {
    const Value* value = root.find(unsupported);
    if (value != nullptr && !value->is_null()) refuse(std::string(unsupported) + " is not supported");
  }
  read_section("model", [&] { impl->read_model(root["model"]); });
  read_section("added_tokens", [&] {
    if (const Value* tokens = root.find("added_tokens")) impl->read_added_tokens(*tokens);
  });
  read_section("normalizer", [&] {
    if (const Value* step = root.find("normalizer")) impl->read_normalizer(*step);
  });
  read_section("pre_tokenizer", [&] {
    if (const Value* step = root.find("pre_tokenizer")) impl->read_pre_tokenizer(*step);
  });
  read_section("decoder", [&] {
    if (const Value* step = root.find("decoder")) impl->read_decoder(*step);
  });
  read_section("post_processor", [&] {
    if (const Value* step = root.find("post_processor")) impl->read_post_processor(*step);
  });

  for (std::size_t i = 0; i < impl->added.size(); ++i) {
    AddedToken& token = impl->added[i];
    token.text = token.normalized ? impl->normalize(token.content) : token.content;
    (token.normalized ? impl->normalized_tokens : impl->raw_tokens)
        .add(token.text, static_cast<int>(i));
  }
  for (const auto& [start, end] : {std::pair<std::string, std::string>{"<|turn>", "<turn|>"},
                                   {"<start_of_turn>", "<end_of_turn>"}}) {
    if (impl->token_to_id(start)) {
      impl->turn = std::make_pair(start, end);
      break;
    }
  }
  return Tokenizer(std::move(impl));
}

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

std::vector<int> Tokenizer::encode(std::string_view text, bool add_special) const {
  return impl_->encode(text, add_special);
}

std::string Tokenizer::decode(const std::vector<int>& ids, bool skip_special) const {
  return impl_->decode_tokens(impl_->tokens_of(ids.data(), ids.size(), skip_special), false);
}

std::vector<int> Tokenizer::encode_prompt(std::string_view text, bool chat) const {
  std::string prompt(text);
  if (chat) {
    if (!impl_->turn) throw Error("chat: this tokenizer has no Gemma turn markers");
    const auto& [start, end] = *impl_->turn;
    prompt = start + "user\n" + prompt + end + "\n" + start + "model\n";
  }
  std::vector<int> ids = encode(prompt, true);
  if (ids.empty()) throw Error("the prompt encodes to no tokens");
  return ids;
}

std::optional<int> Tokenizer::end_of_turn_id() const {
  if (!impl_->turn) return std::nullopt;
  return impl_->token_to_id(impl_->turn->second);
}

std::optional<int> Tokenizer::token_to_id(std::string_view token) const {
  return impl_->token_to_id(token);
}

int Tokenizer::vocab_size() const {
  std::size_t size = impl_->model.vocab.size();
  for (const AddedToken& token : impl_->added) size += impl_->model.vocab.count(token.content) == 0;
  return static_cast<int>(size);
}

Tokenizer::Stream::Stream(const Tokenizer& tokenizer, bool skip_special)
    : tokenizer_(&tokenizer), skip_special_(skip_special) {}

// Releases the text of the ids no later id can change, then forgets them: decoding goes on from
// there (the decoders here decode a text in pieces at such points).
std::string Tokenizer::Stream::push(int id) {
  ids_.push_back(id);
  const Impl& impl = *tokenizer_->impl_;
  const std::size_t settled = impl.settled_ids(ids_, skip_special_);
  if (settled == 0) return {};
  std::vector<std::string> tokens = impl.tokens_of(ids_.data(), settled, skip_special_);
  const bool had_tokens = !tokens.empty();
  std::string text = impl.decode_tokens(std::move(tokens), started_);
  started_ = started_ || had_tokens;
  ids_.erase(ids_.begin(), ids_.begin() + static_cast<std::ptrdiff_t>(settled));
  return text;
}

std::string Tokenizer::Stream::finish() {
  const Impl& impl = *tokenizer_->impl_;
  std::vector<std::string> tokens = impl.tokens_of(ids_.data(), ids_.size(), skip_special_);
  const bool had_tokens = !tokens.empty();
  std::string text = impl.decode_tokens(std::move(tokens), started_);
  started_ = started_ || had_tokens;
  ids_.clear();
  return text;
}

}  // namespace edgemtp
