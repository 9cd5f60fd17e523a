// A small, strict JSON reader and writer (RFC 8259): enough for manifest.json and the
// conformance vectors, with no third-party dependency so that the core builds unchanged with the
// Android NDK, Xcode and the host compiler.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace edgemtp::json {

// Malformed JSON text; the message starts with "line L, column C:".
class ParseError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A value used as the wrong type, or a missing member or index.
class TypeError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Value;
using Array = std::vector<Value>;
using Object = std::map<std::string, Value>;

class Value {
 public:
  enum class Kind { kNull, kBool, kNumber, kString, kArray, kObject };

  Value() = default;  // null
  Value(std::nullptr_t) {}
  Value(bool b);
  Value(int n);
  Value(std::int64_t n);
  Value(double x);
  Value(const char* s);
  Value(std::string s);
  Value(Array items);
  Value(Object members);

  // Parses one JSON text (surrounding whitespace allowed). Nesting deeper than 256 levels,
  // duplicate object keys, and numbers outside double range are errors.
  static Value parse(std::string_view text);

  Kind kind() const { return kind_; }
  bool is_null() const { return kind_ == Kind::kNull; }
  bool is_bool() const { return kind_ == Kind::kBool; }
  bool is_number() const { return kind_ == Kind::kNumber; }
  bool is_integer() const { return kind_ == Kind::kNumber && integral_; }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_array() const { return kind_ == Kind::kArray; }
  bool is_object() const { return kind_ == Kind::kObject; }

  bool as_bool() const;
  double as_number() const;
  std::int64_t as_int() const;  // an integer written without fraction or exponent
  int as_int32() const;         // as_int, in int range
  const std::string& as_string() const;
  const Array& as_array() const;
  const Object& as_object() const;

  // Object member (TypeError naming the key when missing) or nullptr.
  const Value& operator[](const std::string& key) const;
  const Value* find(const std::string& key) const;
  // Array element (TypeError when out of range).
  const Value& operator[](std::size_t index) const;
  std::size_t size() const;  // elements or members

  // Compact JSON text with sorted keys (the order `Object` keeps).
  std::string dump() const;

  friend bool operator==(const Value& a, const Value& b);
  friend bool operator!=(const Value& a, const Value& b) { return !(a == b); }

 private:
  Kind kind_ = Kind::kNull;
  bool bool_ = false;
  bool integral_ = false;
  std::int64_t int_ = 0;
  double number_ = 0.0;
  std::shared_ptr<const std::string> string_;
  std::shared_ptr<const Array> array_;
  std::shared_ptr<const Object> object_;
};

const char* kind_name(Value::Kind kind);

}  // namespace edgemtp::json
