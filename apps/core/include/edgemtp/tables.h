// A bundle's host-side lookup tables (tables.safetensors): the token embeddings and the
// per-layer embeddings, memory-mapped read-only and gathered a row at a time, dequantized and
// scaled exactly as the Python runtime's TokenTables (model/gemma4.py) does. Only the rows a
// prompt touches are ever paged in.
//
// Every format `edgemtp export` writes (export/bundle.py's _table_entries) is read:
//   f32, f16, bf16   <role>.weight              [rows, cols]
//   q4_0             <role>.q4_0  U8            [rows, cols / 32 * 18]  (GGML Q4_0 blocks)
//   q8_0             <role>.q8_0  U8            [rows, cols / 32 * 34]  (GGML Q8_0 blocks)
//   int8_row         <role>.int8  I8 [rows, cols] and <role>.row_scale F16 [rows]
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "edgemtp/json.h"

namespace edgemtp {

// A whole file mapped read-only (POSIX mmap). Throws Error naming the file when it cannot.
class MappedFile {
 public:
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::string& path() const { return path_; }
  const unsigned char* data() const { return data_; }
  std::size_t size() const { return size_; }

 private:
  std::string path_;
  const unsigned char* data_ = nullptr;
  std::size_t size_ = 0;
};

enum class TableFormat { kF32, kF16, kBF16, kQ4_0, kQ8_0, kInt8Row };

// The manifest's name of a format ("q4_0", "int8_row", "bf16", ...).
const char* table_format_name(TableFormat format);

// One table of the file: `rows` x `cols` values in `format`.
class Table {
 public:
  Table() = default;
  Table(TableFormat format, int64_t rows, int64_t cols, const unsigned char* values,
        const unsigned char* row_scales);

  TableFormat format() const { return format_; }
  int64_t rows() const { return rows_; }
  int64_t cols() const { return cols_; }
  // TokenTables' `torch.tensor(scale, dtype=table.dtype).float()`: a quantized table looks up
  // float32 rows, a float table rounds the scale to its own dtype.
  float rounded_scale(double scale) const;
  // Row `row` dequantized to float32 (cols values) and multiplied by `scale`, with float32
  // arithmetic in the order the Python runtime uses.
  void gather(int64_t row, float scale, float* out) const;

 private:
  TableFormat format_ = TableFormat::kF32;
  int64_t rows_ = 0, cols_ = 0;
  const unsigned char* values_ = nullptr;      // row-major, little-endian
  const unsigned char* row_scales_ = nullptr;  // int8_row: fp16 per row
};

// The token (and per-layer) tables of a bundle.
class TokenTables {
 public:
  // Maps `path` and checks it against the manifest's "tables" section (format, shape, tensor
  // names) and the header against both (dtypes, shapes, byte ranges inside the file); a
  // missing, truncated or corrupt file, or one that disagrees with the manifest, is refused
  // with one Error line naming the file and the fix. `hidden_size`, `vocab_size` and
  // `num_layers` are the manifest's model fields the tables must fit.
  static TokenTables open(const std::string& path, const json::Value& description,
                          int hidden_size, int vocab_size, int num_layers);

  int hidden_size() const { return static_cast<int>(tokens_.cols()); }
  int num_layers() const { return num_layers_; }
  bool has_per_layer() const { return has_per_layer_; }
  int per_layer_dim() const { return per_layer_dim_; }  // 0 without a per-layer table
  const Table& tokens() const { return tokens_; }
  const Table& per_layer() const { return per_layer_; }

  // TokenTables.embed: rows of sqrt(hidden)-scaled token embeddings, ids.size() x hidden.
  void embed(const std::vector<int>& ids, float* out) const;
  // TokenTables.per_layer_inputs: ids.size() x layers x per-layer dim, scaled by
  // sqrt(per-layer dim). Call only when has_per_layer().
  void per_layer_inputs(const std::vector<int>& ids, float* out) const;

 private:
  std::shared_ptr<MappedFile> file_;
  Table tokens_;
  Table per_layer_;
  bool has_per_layer_ = false;
  int num_layers_ = 0;
  int per_layer_dim_ = 0;
  float token_scale_ = 1.0f;
  float per_layer_scale_ = 1.0f;
};

}  // namespace edgemtp
