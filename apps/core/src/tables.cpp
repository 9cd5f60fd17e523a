#include "edgemtp/tables.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>

#include "edgemtp/decode.h"

namespace edgemtp {

// --- the mapped file ---------------------------------------------------------------------------

MappedFile::MappedFile(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    throw Error(path + ": cannot open (" + std::strerror(errno) +
                "); copy the whole bundle folder to the device");
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    throw Error(path + ": cannot read (" + std::strerror(err) + ")");
  }
  size_ = static_cast<std::size_t>(st.st_size);
  if (size_ == 0) {
    ::close(fd);
    throw Error(path + ": empty file (truncated copy?); copy the bundle again or export it again");
  }
  void* mapped = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
  int err = errno;
  ::close(fd);  // the mapping keeps the file open
  if (mapped == MAP_FAILED) {
    throw Error(path + ": cannot memory-map (" + std::strerror(err) + ")");
  }
  // Lookups touch scattered rows: read-ahead would only page in rows nobody asked for.
  ::posix_madvise(mapped, size_, POSIX_MADV_RANDOM);
  data_ = static_cast<const unsigned char*>(mapped);
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<unsigned char*>(data_), size_);
}

// --- number formats ----------------------------------------------------------------------------

namespace {

constexpr int64_t kBlock = 32;          // values per GGML block
constexpr int64_t kQ4_0BlockBytes = 18;  // fp16 scale + 16 bytes of nibbles
constexpr int64_t kQ8_0BlockBytes = 34;  // fp16 scale + 32 int8

uint16_t u16(const unsigned char* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }

uint32_t u32(const unsigned char* p) {
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
         (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24);
}

float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

uint32_t float_to_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f) return bits_to_float(sign | 0x7f800000u | (mantissa << 13));  // inf, NaN
  if (exponent == 0) {
    if (mantissa == 0) return bits_to_float(sign);
    // Subnormal: normalize into float's wider exponent range.
    exponent = 1;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --exponent;
    }
    mantissa &= 0x3ffu;
  }
  return bits_to_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

// Round-to-nearest-even float -> fp16, as c10::Half(float).
uint16_t float_to_half(float f) {
  const uint32_t bits = float_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs_bits = bits & 0x7fffffffu;
  if (abs_bits >= 0x7f800000u) {  // inf, NaN
    return static_cast<uint16_t>(sign | (abs_bits > 0x7f800000u ? 0x7e00u : 0x7c00u));
  }
  if (abs_bits >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (abs_bits < 0x38800000u) {  // below fp16's smallest normal: a subnormal (or zero)
    const float scaled = bits_to_float(abs_bits) * 16777216.0f;  // exact: * 2^24
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(std::nearbyint(scaled)));
  }
  const uint32_t rounded = abs_bits + 0xfffu + ((abs_bits >> 13) & 1u);  // nearest, ties to even
  return static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
}

// Round-to-nearest-even float -> bfloat16, as c10::BFloat16(float) (finite values).
float round_to_bf16(float f) {
  const uint32_t bits = float_to_bits(f);
  const uint32_t rounded = bits + 0x7fffu + ((bits >> 16) & 1u);
  return bits_to_float(rounded & 0xffff0000u);
}

int64_t element_bytes(const std::string& dtype) {
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "F16" || dtype == "BF16" || dtype == "I16" || dtype == "U16") return 2;
  if (dtype == "U8" || dtype == "I8" || dtype == "BOOL") return 1;
  if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
  return 0;
}

}  // namespace

const char* table_format_name(TableFormat format) {
  switch (format) {
    case TableFormat::kF32: return "f32";
    case TableFormat::kF16: return "f16";
    case TableFormat::kBF16: return "bf16";
    case TableFormat::kQ4_0: return "q4_0";
    case TableFormat::kQ8_0: return "q8_0";
    case TableFormat::kInt8Row: return "int8_row";
  }
  return "?";
}

// --- one table ---------------------------------------------------------------------------------

Table::Table(TableFormat format, int64_t rows, int64_t cols, const unsigned char* values,
             const unsigned char* row_scales)
    : format_(format), rows_(rows), cols_(cols), values_(values), row_scales_(row_scales) {}

float Table::rounded_scale(double scale) const {
  // torch.tensor(python_float, dtype=...) narrows the double to float first, then to the dtype.
  const float f = static_cast<float>(scale);
  if (format_ == TableFormat::kF16) return half_to_float(float_to_half(f));
  if (format_ == TableFormat::kBF16) return round_to_bf16(f);
  return f;
}

void Table::gather(int64_t row, float scale, float* out) const {
  const int64_t n = cols_;
  switch (format_) {
    case TableFormat::kF32: {
      const unsigned char* p = values_ + row * n * 4;
      for (int64_t j = 0; j < n; ++j) out[j] = bits_to_float(u32(p + 4 * j)) * scale;
      return;
    }
    case TableFormat::kF16: {
      const unsigned char* p = values_ + row * n * 2;
      for (int64_t j = 0; j < n; ++j) out[j] = half_to_float(u16(p + 2 * j)) * scale;
      return;
    }
    case TableFormat::kBF16: {
      const unsigned char* p = values_ + row * n * 2;
      for (int64_t j = 0; j < n; ++j) {
        out[j] = bits_to_float(static_cast<uint32_t>(u16(p + 2 * j)) << 16) * scale;
      }
      return;
    }
    case TableFormat::kQ4_0: {
      // Per block: fp16 d, then 16 bytes holding code j in the low and code j + 16 in the high
      // nibble; value = (code - 8) * d (exact in float32), then scaled.
      const unsigned char* p = values_ + row * (n / kBlock) * kQ4_0BlockBytes;
      for (int64_t b = 0; b < n / kBlock; ++b, p += kQ4_0BlockBytes) {
        const float d = half_to_float(u16(p));
        float* o = out + b * kBlock;
        for (int j = 0; j < 16; ++j) {
          o[j] = ((static_cast<float>(p[2 + j] & 0x0f) - 8.0f) * d) * scale;
          o[j + 16] = ((static_cast<float>(p[2 + j] >> 4) - 8.0f) * d) * scale;
        }
      }
      return;
    }
    case TableFormat::kQ8_0: {
      const unsigned char* p = values_ + row * (n / kBlock) * kQ8_0BlockBytes;
      for (int64_t b = 0; b < n / kBlock; ++b, p += kQ8_0BlockBytes) {
        const float d = half_to_float(u16(p));
        float* o = out + b * kBlock;
        for (int j = 0; j < kBlock; ++j) {
          o[j] = (static_cast<float>(static_cast<int8_t>(p[2 + j])) * d) * scale;
        }
      }
      return;
    }
    case TableFormat::kInt8Row: {
      const float row_scale = half_to_float(u16(row_scales_ + 2 * row));
      const unsigned char* p = values_ + row * n;
      for (int64_t j = 0; j < n; ++j) {
        out[j] = (static_cast<float>(static_cast<int8_t>(p[j])) * row_scale) * scale;
      }
      return;
    }
  }
}

// --- the tables file ---------------------------------------------------------------------------

namespace {

struct Entry {
  std::string dtype;
  std::vector<int64_t> shape;
  int64_t begin = 0, end = 0;  // byte range within the data section
};

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    out += (i ? ", " : "") + std::to_string(shape[i]);
  }
  return out + "]";
}

struct Expected {
  std::string name, dtype;
  std::vector<int64_t> shape;
};

class TablesReader {
 public:
  TablesReader(const MappedFile& file, const json::Value& description)
      : file_(file), description_(description) {
    read_header();
  }

  Table table(const std::string& role) {
    const json::Value& d = role_description(role);
    const std::string& format_name = manifest_string(d, "format", role);
    TableFormat format;
    if (!parse_format(format_name, format)) {
      throw Error(file_.path() + ": the manifest's tables." + role + ".format '" + format_name +
                  "' is not one this app reads (f32, f16, bf16, q4_0, q8_0, int8_row); update "
                  "the app or export the bundle again");
    }
    std::vector<int64_t> shape = manifest_shape(d, role);
    const int64_t rows = shape[0], cols = shape[1];
    if ((format == TableFormat::kQ4_0 || format == TableFormat::kQ8_0) && cols % kBlock != 0) {
      manifest_mismatch("tables." + role + ".shape " + shape_text(shape) +
                        " is not a whole number of " + format_name + " blocks of 32");
    }
    std::vector<Expected> expected = expected_tensors(role, format, rows, cols);
    check_tensor_names(d, role, expected);
    std::vector<const unsigned char*> data;
    for (const Expected& e : expected) data.push_back(tensor(e));
    return Table(format, rows, cols, data[0], data.size() > 1 ? data[1] : nullptr);
  }

  bool has(const std::string& role) const { return description_.find(role) != nullptr; }

  std::vector<int64_t> manifest_shape(const json::Value& d, const std::string& role) const {
    const json::Value* shape = d.find("shape");
    std::vector<int64_t> out;
    if (shape != nullptr && shape->is_array()) {
      for (const json::Value& x : shape->as_array()) {
        if (!x.is_integer() || x.as_int() < 1) break;
        out.push_back(x.as_int());
      }
    }
    if (shape == nullptr || out.size() != 2 || shape->size() != 2) {
      manifest_mismatch("tables." + role + ".shape must be [rows, cols] of positive integers");
    }
    return out;
  }

  const json::Value& role_description(const std::string& role) const {
    const json::Value* d = description_.find(role);
    if (d == nullptr || !d->is_object()) manifest_mismatch("tables." + role + " is missing");
    return *d;
  }

  [[noreturn]] void manifest_mismatch(const std::string& what) const {
    throw Error(file_.path() + ": " + what +
                " in manifest.json; the manifest and the tables do not belong together: export "
                "the bundle again");
  }

 private:
  [[noreturn]] void corrupt(const std::string& what) const {
    throw Error(file_.path() + ": " + what +
                "; the file is truncated or corrupt: copy the bundle again or export it again");
  }

  void read_header() {
    const std::size_t size = file_.size();
    if (size < 8) corrupt("only " + std::to_string(size) + " bytes (no safetensors header)");
    uint64_t header_bytes = 0;
    for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | file_.data()[i];
    if (header_bytes > size - 8 || header_bytes > (uint64_t{100} << 20)) {
      corrupt("the header declares " + std::to_string(header_bytes) + " bytes, the file has " +
              std::to_string(size));
    }
    data_start_ = 8 + static_cast<int64_t>(header_bytes);
    data_bytes_ = static_cast<int64_t>(size) - data_start_;
    json::Value header;
    try {
      header = json::Value::parse(std::string_view(
          reinterpret_cast<const char*>(file_.data() + 8), static_cast<std::size_t>(header_bytes)));
    } catch (const json::ParseError& e) {
      corrupt(std::string("the safetensors header is not valid JSON (") + e.what() + ")");
    }
    if (!header.is_object()) corrupt("the safetensors header is not a JSON object");
    for (const auto& [name, info] : header.as_object()) {
      if (name == "__metadata__") continue;
      entries_.emplace_back(name, parse_entry(name, info));
    }
  }

  Entry parse_entry(const std::string& name, const json::Value& info) const {
    const std::string bad = "safetensors entry '" + name + "' is malformed";
    if (!info.is_object()) corrupt(bad);
    const json::Value* dtype = info.find("dtype");
    const json::Value* shape = info.find("shape");
    const json::Value* offsets = info.find("data_offsets");
    if (dtype == nullptr || !dtype->is_string() || shape == nullptr || !shape->is_array() ||
        offsets == nullptr || !offsets->is_array() || offsets->size() != 2) {
      corrupt(bad);
    }
    Entry e;
    e.dtype = dtype->as_string();
    const int64_t width = element_bytes(e.dtype);
    if (width == 0) corrupt(bad + " (unknown dtype " + e.dtype + ")");
    int64_t count = 1;
    for (const json::Value& x : shape->as_array()) {
      if (!x.is_integer() || x.as_int() < 0 || x.as_int() > (int64_t{1} << 40)) corrupt(bad);
      e.shape.push_back(x.as_int());
      count *= x.as_int();
      if (count > (int64_t{1} << 48)) corrupt(bad);
    }
    if (!(*offsets)[0].is_integer() || !(*offsets)[1].is_integer()) corrupt(bad);
    e.begin = (*offsets)[0].as_int();
    e.end = (*offsets)[1].as_int();
    if (e.begin < 0 || e.end < e.begin || e.end - e.begin != count * width) {
      corrupt(bad + " (its byte range does not hold its shape)");
    }
    if (e.end > data_bytes_) {
      corrupt("tensor '" + name + "' ends at byte " + std::to_string(data_start_ + e.end) +
              " of a " + std::to_string(file_.size()) + "-byte file");
    }
    return e;
  }

  static bool parse_format(const std::string& name, TableFormat& out) {
    for (TableFormat f : {TableFormat::kF32, TableFormat::kF16, TableFormat::kBF16,
                          TableFormat::kQ4_0, TableFormat::kQ8_0, TableFormat::kInt8Row}) {
      if (name == table_format_name(f)) {
        out = f;
        return true;
      }
    }
    return false;
  }

  static std::vector<Expected> expected_tensors(const std::string& role, TableFormat format,
                                                int64_t rows, int64_t cols) {
    switch (format) {
      case TableFormat::kF32: return {{role + ".weight", "F32", {rows, cols}}};
      case TableFormat::kF16: return {{role + ".weight", "F16", {rows, cols}}};
      case TableFormat::kBF16: return {{role + ".weight", "BF16", {rows, cols}}};
      case TableFormat::kQ4_0:
        return {{role + ".q4_0", "U8", {rows, cols / kBlock * kQ4_0BlockBytes}}};
      case TableFormat::kQ8_0:
        return {{role + ".q8_0", "U8", {rows, cols / kBlock * kQ8_0BlockBytes}}};
      case TableFormat::kInt8Row:
        return {{role + ".int8", "I8", {rows, cols}}, {role + ".row_scale", "F16", {rows}}};
    }
    return {};
  }

  const std::string& manifest_string(const json::Value& d, const std::string& key,
                                     const std::string& role) const {
    const json::Value* v = d.find(key);
    if (v == nullptr || !v->is_string()) {
      manifest_mismatch("tables." + role + "." + key + " is missing");
    }
    return v->as_string();
  }

  void check_tensor_names(const json::Value& d, const std::string& role,
                          const std::vector<Expected>& expected) const {
    const json::Value* names = d.find("tensors");
    bool same = names != nullptr && names->is_array() && names->size() == expected.size();
    for (std::size_t i = 0; same && i < expected.size(); ++i) {
      same = (*names)[i].is_string() && (*names)[i].as_string() == expected[i].name;
    }
    if (!same) {
      std::string list;
      for (const Expected& e : expected) list += (list.empty() ? "" : ", ") + e.name;
      manifest_mismatch("tables." + role + ".tensors should be [" + list + "] for its format");
    }
  }

  const unsigned char* tensor(const Expected& expected) const {
    for (const auto& [name, e] : entries_) {
      if (name != expected.name) continue;
      if (e.dtype != expected.dtype || e.shape != expected.shape) {
        manifest_mismatch("the file's '" + name + "' is " + e.dtype + " " + shape_text(e.shape) +
                          ", but the manifest's table needs " + expected.dtype + " " +
                          shape_text(expected.shape));
      }
      return file_.data() + data_start_ + e.begin;
    }
    manifest_mismatch("tensor '" + expected.name + "' is named but the file has no such tensor");
  }

  const MappedFile& file_;
  const json::Value& description_;
  int64_t data_start_ = 0, data_bytes_ = 0;
  std::vector<std::pair<std::string, Entry>> entries_;
};

}  // namespace

TokenTables TokenTables::open(const std::string& path, const json::Value& description,
                              int hidden_size, int vocab_size, int num_layers) {
  if (!description.is_object()) {
    throw Error(path + ": manifest.json has no tables section; export the bundle again");
  }
  TokenTables t;
  t.file_ = std::make_shared<MappedFile>(path);
  TablesReader reader(*t.file_, description);
  t.tokens_ = reader.table("token");
  if (t.tokens_.rows() != vocab_size || t.tokens_.cols() != hidden_size) {
    reader.manifest_mismatch("the token table is " + std::to_string(t.tokens_.rows()) + " x " +
                             std::to_string(t.tokens_.cols()) + ", the model has vocabulary " +
                             std::to_string(vocab_size) + " and hidden size " +
                             std::to_string(hidden_size));
  }
  t.num_layers_ = num_layers;
  t.token_scale_ = t.tokens_.rounded_scale(std::sqrt(static_cast<double>(hidden_size)));
  if (reader.has("ple")) {
    t.per_layer_ = reader.table("ple");
    if (num_layers < 1 || t.per_layer_.cols() % num_layers != 0) {
      reader.manifest_mismatch("the per-layer table's " + std::to_string(t.per_layer_.cols()) +
                               " columns are not " + std::to_string(num_layers) +
                               " layers of equal width");
    }
    t.has_per_layer_ = true;
    t.per_layer_dim_ = static_cast<int>(t.per_layer_.cols() / num_layers);
    t.per_layer_scale_ =
        t.per_layer_.rounded_scale(std::sqrt(static_cast<double>(t.per_layer_dim_)));
  }
  return t;
}

namespace {

void check_id(int id, const Table& table, const char* what) {
  if (id < 0 || id >= table.rows()) {
    throw Error("token id " + std::to_string(id) + " is outside the " + what + " table (0.." +
                std::to_string(table.rows() - 1) + ")");
  }
}

}  // namespace

void TokenTables::embed(const std::vector<int>& ids, float* out) const {
  const int64_t cols = tokens_.cols();
  for (std::size_t i = 0; i < ids.size(); ++i) {
    check_id(ids[i], tokens_, "token embedding");
    tokens_.gather(ids[i], token_scale_, out + static_cast<int64_t>(i) * cols);
  }
}

void TokenTables::per_layer_inputs(const std::vector<int>& ids, float* out) const {
  if (!has_per_layer_) throw Error("this bundle has no per-layer embedding table");
  const int64_t cols = per_layer_.cols();
  for (std::size_t i = 0; i < ids.size(); ++i) {
    check_id(ids[i], per_layer_, "per-layer embedding");
    per_layer_.gather(ids[i], per_layer_scale_, out + static_cast<int64_t>(i) * cols);
  }
}

}  // namespace edgemtp
