// Prints the rows the engine gathers from a bundle's tables, for comparison with the Python
// runtime's TokenTables (model/gemma4.py).
//
//   tables_dump MANIFEST.json ID[,ID...]
//
// MANIFEST.json: a bundle's manifest (only "tables" and model.hidden_size, .vocab_size and
// .num_layers are read; the tables file is next to it). Prints one JSON line:
// {"embed": [[bits...] per id], "per_layer": [[bits...] per id] or null, "formats": {...}},
// each float32 as its IEEE-754 bit pattern (an exact comparison). Exit 1 with the Error's one
// line on stderr; 2: usage.
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "edgemtp/decode.h"
#include "edgemtp/json.h"
#include "edgemtp/tables.h"

namespace {

using edgemtp::json::Array;
using edgemtp::json::Object;
using edgemtp::json::Value;

Value bit_rows(const std::vector<float>& values, std::size_t ids, std::size_t width) {
  Array rows;
  for (std::size_t i = 0; i < ids; ++i) {
    Array row;
    for (std::size_t j = 0; j < width; ++j) {
      uint32_t bits;
      std::memcpy(&bits, &values[i * width + j], sizeof bits);
      row.emplace_back(static_cast<int64_t>(bits));
    }
    rows.emplace_back(std::move(row));
  }
  return Value(std::move(rows));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: tables_dump MANIFEST.json ID[,ID...]\n";
    return 2;
  }
  const std::string manifest_path = argv[1];
  std::vector<int> ids;
  std::stringstream list(argv[2]);
  for (std::string item; std::getline(list, item, ',');) ids.push_back(std::stoi(item));
  try {
    std::ifstream in(manifest_path);
    if (!in) throw edgemtp::Error(manifest_path + ": cannot read");
    std::stringstream text;
    text << in.rdbuf();
    const Value manifest = Value::parse(text.str());
    const Value& model = manifest["model"];
    const std::size_t slash = manifest_path.rfind('/');
    const std::string dir = slash == std::string::npos ? "." : manifest_path.substr(0, slash);
    const Value& description = manifest["tables"];
    const edgemtp::TokenTables tables = edgemtp::TokenTables::open(
        dir + "/" + description["file"].as_string(), description, model["hidden_size"].as_int32(),
        model["vocab_size"].as_int32(), model["num_layers"].as_int32());

    const auto hidden = static_cast<std::size_t>(tables.hidden_size());
    std::vector<float> embeds(ids.size() * hidden);
    tables.embed(ids, embeds.data());
    Object out{{"embed", bit_rows(embeds, ids.size(), hidden)}, {"per_layer", Value()}};
    Object formats{{"token", Value(edgemtp::table_format_name(tables.tokens().format()))}};
    if (tables.has_per_layer()) {
      const auto width = static_cast<std::size_t>(tables.num_layers() * tables.per_layer_dim());
      std::vector<float> ple(ids.size() * width);
      tables.per_layer_inputs(ids, ple.data());
      out["per_layer"] = bit_rows(ple, ids.size(), width);
      formats["ple"] = Value(edgemtp::table_format_name(tables.per_layer().format()));
    }
    out["formats"] = Value(std::move(formats));
    std::cout << Value(std::move(out)).dump() << "\n";
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";
    return 1;
  }
  return 0;
}
