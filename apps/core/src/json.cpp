#include "edgemtp/json.h"

#include <charconv>
#include <cmath>
#include <limits>
#include <locale>
#include <sstream>
#include <string>
#include <system_error>
#include <utility>

#include "edgemtp/utf8.h"

namespace edgemtp::json {

const char* kind_name(Value::Kind kind) {
  switch (kind) {
    case Value::Kind::kNull: return "null";
    case Value::Kind::kBool: return "a boolean";
    case Value::Kind::kNumber: return "a number";
    case Value::Kind::kString: return "a string";
    case Value::Kind::kArray: return "an array";
    case Value::Kind::kObject: return "an object";
  }
  return "?";
}

Value::Value(bool b) : kind_(Kind::kBool), bool_(b) {}
Value::Value(int n) : Value(static_cast<std::int64_t>(n)) {}
Value::Value(std::int64_t n)
    : kind_(Kind::kNumber), integral_(true), int_(n), number_(static_cast<double>(n)) {}
Value::Value(double x) : kind_(Kind::kNumber), number_(x) {
  if (!std::isfinite(x)) throw TypeError("JSON numbers are finite");
}
Value::Value(const char* s) : Value(std::string(s)) {}
Value::Value(std::string s)
    : kind_(Kind::kString), string_(std::make_shared<const std::string>(std::move(s))) {}
Value::Value(Array items)
    : kind_(Kind::kArray), array_(std::make_shared<const Array>(std::move(items))) {}
Value::Value(Object members)
    : kind_(Kind::kObject), object_(std::make_shared<const Object>(std::move(members))) {}

namespace {

[[noreturn]] void wrong(const char* wanted, Value::Kind got) {
  throw TypeError(std::string("expected ") + wanted + ", got " + kind_name(got));
}

}  // namespace

bool Value::as_bool() const {
  if (kind_ != Kind::kBool) wrong("a boolean", kind_);
  return bool_;
}

double Value::as_number() const {
  if (kind_ != Kind::kNumber) wrong("a number", kind_);
  return number_;
}

std::int64_t Value::as_int() const {
  if (kind_ != Kind::kNumber) wrong("an integer", kind_);
  if (!integral_) throw TypeError("expected an integer, got " + dump());
  return int_;
}

int Value::as_int32() const {
  std::int64_t n = as_int();
  if (n < std::numeric_limits<int>::min() || n > std::numeric_limits<int>::max()) {
    throw TypeError("integer " + std::to_string(n) + " is out of range");
  }
  return static_cast<int>(n);
}

const std::string& Value::as_string() const {
  if (kind_ != Kind::kString) wrong("a string", kind_);
  return *string_;
}

const Array& Value::as_array() const {
  if (kind_ != Kind::kArray) wrong("an array", kind_);
  return *array_;
}

const Object& Value::as_object() const {
  if (kind_ != Kind::kObject) wrong("an object", kind_);
  return *object_;
}

const Value* Value::find(const std::string& key) const {
  const Object& members = as_object();
  auto it = members.find(key);
  return it == members.end() ? nullptr : &it->second;
}

const Value& Value::operator[](const std::string& key) const {
  const Value* v = find(key);
  if (v == nullptr) throw TypeError("missing member \"" + key + "\"");
  return *v;
}

const Value& Value::operator[](std::size_t index) const {
  const Array& items = as_array();
  if (index >= items.size()) {
    throw TypeError("index " + std::to_string(index) + " is past the array's " +
                    std::to_string(items.size()) + " elements");
  }
  return items[index];
}

std::size_t Value::size() const {
  if (kind_ == Kind::kArray) return array_->size();
  if (kind_ == Kind::kObject) return object_->size();
  wrong("an array or object", kind_);
}

bool operator==(const Value& a, const Value& b) {
  if (a.kind_ != b.kind_) return false;
  switch (a.kind_) {
    case Value::Kind::kNull: return true;
    case Value::Kind::kBool: return a.bool_ == b.bool_;
    case Value::Kind::kNumber:
      if (a.integral_ && b.integral_) return a.int_ == b.int_;
      return a.number_ == b.number_;
    case Value::Kind::kString: return *a.string_ == *b.string_;
    case Value::Kind::kArray: return *a.array_ == *b.array_;
    case Value::Kind::kObject: return *a.object_ == *b.object_;
  }
  return false;
}

// --- writing -------------------------------------------------------------------------------------

namespace {

void dump_string(const std::string& s, std::string& out) {
  static const char* hex = "0123456789abcdef";
  out += '"';
  for (char c : s) {
    auto u = static_cast<unsigned char>(c);
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (u < 0x20) {
          out += "\\u00";
          out += hex[u >> 4];
          out += hex[u & 0xF];
        } else {
          out += c;
        }
    }
  }
  out += '"';
}

void dump_value(const Value& v, std::string& out) {
  switch (v.kind()) {
    case Value::Kind::kNull: out += "null"; break;
    case Value::Kind::kBool: out += v.as_bool() ? "true" : "false"; break;
    case Value::Kind::kNumber:
      if (v.is_integer()) {
        out += std::to_string(v.as_int());
      } else {
        // Streams in the classic locale: floating-point to_chars/from_chars are missing from
        // older libc++ (Xcode, the NDK).
        std::ostringstream text;
        text.imbue(std::locale::classic());
        text.precision(17);
        text << v.as_number();
        out += text.str();
      }
      break;
    case Value::Kind::kString: dump_string(v.as_string(), out); break;
    case Value::Kind::kArray: {
      out += '[';
      bool first = true;
      for (const Value& item : v.as_array()) {
        if (!first) out += ", ";
        first = false;
        dump_value(item, out);
      }
      out += ']';
      break;
    }
    case Value::Kind::kObject: {
      out += '{';
      bool first = true;
      for (const auto& [key, item] : v.as_object()) {
        if (!first) out += ", ";
        first = false;
        dump_string(key, out);
        out += ": ";
        dump_value(item, out);
      }
      out += '}';
      break;
    }
  }
}

}  // namespace

std::string Value::dump() const {
  std::string out;
  dump_value(*this, out);
  return out;
}

// --- parsing -------------------------------------------------------------------------------------

class Parser {
 public:
  explicit Parser(std::string_view text) : text_(text) {}

  Value document() {
    skip_space();
    Value v = value(0);
    skip_space();
    if (pos_ != text_.size()) fail("unexpected text after the JSON value");
    return v;
  }

 private:
  static constexpr int kMaxDepth = 256;
  std::string_view text_;
  std::size_t pos_ = 0;

  [[noreturn]] void fail(const std::string& message) const {
    std::size_t line = 1, column = 1;
    for (std::size_t i = 0; i < pos_ && i < text_.size(); ++i) {
      if (text_[i] == '\n') {
        ++line;
        column = 1;
      } else {
        ++column;
      }
    }
    throw ParseError("line " + std::to_string(line) + ", column " + std::to_string(column) +
                     ": " + message);
  }

  bool at_end() const { return pos_ >= text_.size(); }
  char peek() const { return at_end() ? '\0' : text_[pos_]; }

  void skip_space() {
    while (!at_end() && (peek() == ' ' || peek() == '\t' || peek() == '\n' || peek() == '\r')) {
      ++pos_;
    }
  }

  void expect(char c) {
    if (peek() != c || at_end()) fail(std::string("expected '") + c + "'");
    ++pos_;
  }

  void literal(std::string_view word) {
    if (text_.substr(pos_, word.size()) != word) fail("invalid literal");
    pos_ += word.size();
  }

  Value value(int depth) {
    if (depth > kMaxDepth) fail("nesting deeper than 256 levels");
    if (at_end()) fail("unexpected end of text");
    switch (peek()) {
      case '{': return object(depth);
      case '[': return array(depth);
      case '"': return Value(string());
      case 't': literal("true"); return Value(true);
      case 'f': literal("false"); return Value(false);
      case 'n': literal("null"); return Value();
      default:
        if (peek() == '-' || (peek() >= '0' && peek() <= '9')) return number();
        fail("unexpected character");
    }
  }

  Value object(int depth) {
    expect('{');
    Object members;
    skip_space();
    if (peek() == '}') {
      ++pos_;
      return Value(std::move(members));
    }
    while (true) {
      skip_space();
      if (peek() != '"') fail("expected a string key");
      std::size_t key_at = pos_;
      std::string key = string();
      skip_space();
      expect(':');
      skip_space();
      Value item = value(depth + 1);
      if (!members.emplace(key, std::move(item)).second) {
        pos_ = key_at;
        fail("duplicate key \"" + key + "\"");
      }
      skip_space();
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      expect('}');
      return Value(std::move(members));
    }
  }

  Value array(int depth) {
    expect('[');
    Array items;
    skip_space();
    if (peek() == ']') {
      ++pos_;
      return Value(std::move(items));
    }
    while (true) {
      skip_space();
      items.push_back(value(depth + 1));
      skip_space();
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      expect(']');
      return Value(std::move(items));
    }
  }

  unsigned hex4() {
    if (pos_ + 4 > text_.size()) fail("truncated \\u escape");
    unsigned code = 0;
    for (int i = 0; i < 4; ++i) {
      char c = text_[pos_++];
      code <<= 4;
      if (c >= '0' && c <= '9') {
        code |= static_cast<unsigned>(c - '0');
      } else if (c >= 'a' && c <= 'f') {
        code |= static_cast<unsigned>(c - 'a' + 10);
      } else if (c >= 'A' && c <= 'F') {
        code |= static_cast<unsigned>(c - 'A' + 10);
      } else {
        --pos_;
        fail("invalid hex digit in \\u escape");
      }
    }
    return code;
  }

  std::string string() {
    expect('"');
    std::string out;
    while (true) {
      if (at_end()) fail("unterminated string");
      char c = text_[pos_];
      if (c == '"') {
        ++pos_;
        return out;
      }
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in a string");
      if (c != '\\') {
        out += c;
        ++pos_;
        continue;
      }
      ++pos_;
      if (at_end()) fail("unterminated string");
      char e = text_[pos_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          unsigned code = hex4();
          if (code >= 0xD800 && code <= 0xDBFF) {  // a high surrogate needs its low half
            if (text_.substr(pos_, 2) != "\\u") fail("unpaired surrogate in \\u escape");
            pos_ += 2;
            unsigned low = hex4();
            if (low < 0xDC00 || low > 0xDFFF) fail("unpaired surrogate in \\u escape");
            code = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00);
          } else if (code >= 0xDC00 && code <= 0xDFFF) {
            fail("unpaired surrogate in \\u escape");
          }
          append_utf8(out, code);
          break;
        }
        default:
          --pos_;
          fail("invalid escape in a string");
      }
    }
  }

  Value number() {
    std::size_t start = pos_;
    bool integral = true;
    if (peek() == '-') ++pos_;
    if (peek() == '0') {
      ++pos_;
    } else if (peek() >= '1' && peek() <= '9') {
      while (peek() >= '0' && peek() <= '9') ++pos_;
    } else {
      fail("invalid number");
    }
    if (peek() == '.') {
      integral = false;
      ++pos_;
      if (!(peek() >= '0' && peek() <= '9')) fail("invalid number: digits must follow '.'");
      while (peek() >= '0' && peek() <= '9') ++pos_;
    }
    if (peek() == 'e' || peek() == 'E') {
      integral = false;
      ++pos_;
      if (peek() == '+' || peek() == '-') ++pos_;
      if (!(peek() >= '0' && peek() <= '9')) fail("invalid number: digits must follow 'e'");
      while (peek() >= '0' && peek() <= '9') ++pos_;
    }
    const char* first = text_.data() + start;
    const char* last = text_.data() + pos_;
    if (integral) {
      std::int64_t n = 0;
      auto [end, ec] = std::from_chars(first, last, n);
      if (ec == std::errc() && end == last) return Value(n);
      // Too large for int64: kept as a double, which as_int() refuses.
    }
    std::istringstream digits(std::string(first, last));
    digits.imbue(std::locale::classic());
    double x = 0.0;
    digits >> x;
    if (digits.fail() || !std::isfinite(x)) {
      pos_ = start;
      fail("number out of range");
    }
    return Value(x);
  }
};

Value Value::parse(std::string_view text) { return Parser(text).document(); }

}  // namespace edgemtp::json
