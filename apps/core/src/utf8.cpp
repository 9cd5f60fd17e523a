#include "edgemtp/utf8.h"

namespace edgemtp {

Utf8Sequence scan_utf8(std::string_view s, std::size_t i) {
  const auto lead = static_cast<unsigned char>(s[i]);
  if (lead < 0x80) return {1, true, false};
  std::size_t continuation = 0;
  unsigned char low = 0x80, high = 0xBF;  // the range of the second byte
  if (lead >= 0xC2 && lead <= 0xDF) {
    continuation = 1;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    continuation = 2;
    if (lead == 0xE0) low = 0xA0;
    if (lead == 0xED) high = 0x9F;  // no surrogates
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    continuation = 3;
    if (lead == 0xF0) low = 0x90;
    if (lead == 0xF4) high = 0x8F;  // nothing past U+10FFFF
  } else {
    return {1, false, false};
  }
  for (std::size_t n = 1; n <= continuation; ++n) {
    if (i + n >= s.size()) return {n, false, true};
    const auto byte = static_cast<unsigned char>(s[i + n]);
    if (byte < low || byte > high) return {n, false, false};
    low = 0x80;
    high = 0xBF;
  }
  return {continuation + 1, true, false};
}

bool is_valid_utf8(std::string_view s) {
  for (std::size_t i = 0; i < s.size();) {
    const Utf8Sequence seq = scan_utf8(s, i);
    if (!seq.complete) return false;
    i += seq.length;
  }
  return true;
}

std::string lossy_utf8(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  for (std::size_t i = 0; i < bytes.size();) {
    const Utf8Sequence seq = scan_utf8(bytes, i);
    if (seq.complete) {
      out.append(bytes.substr(i, seq.length));
    } else {
      out.append(kReplacementCharacter);
    }
    i += seq.length;
  }
  return out;
}

std::size_t truncated_tail(std::string_view bytes) {
  for (std::size_t i = 0; i < bytes.size();) {
    const Utf8Sequence seq = scan_utf8(bytes, i);
    if (seq.truncated) return i;
    i += seq.length;
  }
  return bytes.size();
}

char32_t decode_utf8(std::string_view s, std::size_t i, std::size_t& length) {
  const auto lead = static_cast<unsigned char>(s[i]);
  if (lead < 0x80) {
    length = 1;
    return lead;
  }
  length = lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : 2;
  char32_t c = lead & (0x7F >> length);
  for (std::size_t n = 1; n < length; ++n) {
    c = (c << 6) | (static_cast<unsigned char>(s[i + n]) & 0x3F);
  }
  return c;
}

void append_utf8(std::string& out, char32_t c) {
  if (c < 0x80) {
    out += static_cast<char>(c);
  } else if (c < 0x800) {
    out += static_cast<char>(0xC0 | (c >> 6));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    out += static_cast<char>(0xE0 | (c >> 12));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (c >> 18));
    out += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  }
}

std::size_t utf8_length(std::string_view s) {
  std::size_t count = 0;
  for (char ch : s) count += (static_cast<unsigned char>(ch) & 0xC0) != 0x80;
  return count;
}

}  // namespace edgemtp
