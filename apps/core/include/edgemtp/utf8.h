// UTF-8 as the core reads and writes it: the tokenizer's byte-level text and lossy decoding
// (Rust's String::from_utf8_lossy, as `tokenizers`), the JSON parser's escapes, and the apps'
// bridges to UTF-16 platform strings.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace edgemtp {

inline constexpr std::string_view kReplacementCharacter = "\xEF\xBF\xBD";  // U+FFFD

// The UTF-8 sequence at s[i]: `length` bytes, a whole character when `complete`. Otherwise it is
// the longest start of a well-formed sequence (at least one byte), which lossy decoding replaces
// with one U+FFFD, and `truncated` when it ran into the end of s (more bytes could complete it).
struct Utf8Sequence {
  std::size_t length = 1;
  bool complete = false;
  bool truncated = false;
};

Utf8Sequence scan_utf8(std::string_view s, std::size_t i);
bool is_valid_utf8(std::string_view s);
// Each ill-formed sequence becomes one U+FFFD (Rust's String::from_utf8_lossy).
std::string lossy_utf8(std::string_view bytes);
// Where a trailing sequence that more bytes could complete starts, or bytes.size().
std::size_t truncated_tail(std::string_view bytes);
// The character of valid UTF-8 at s[i]; `length` gets its bytes.
char32_t decode_utf8(std::string_view s, std::size_t i, std::size_t& length);
void append_utf8(std::string& out, char32_t c);
// Characters in valid UTF-8.
std::size_t utf8_length(std::string_view s);

}  // namespace edgemtp
