// engine_pipe: an edgemtp::Engine whose MethodRunner is whoever answers on stdin, so that a
// test can run any bundle's methods in Python (ONNX Runtime, the Core ML forms in torch) while
// the engine (host-side cache arrays, slot positions, tables, decoding) is the C++ one. The
// options and the final JSON line: engine_cli.cpp.
//
// Each method call is a request on stdout:
//   CALL {"method": M, "inputs": [{"name", "dtype", "shape"}, ...]}\n  then each input's bytes
// answered on stdin by
//   {"outputs": [{"name", "dtype", "shape"}, ...]}\n  then each output's bytes
// or {"error": "..."}\n. dtype is "float32" or "int64"; bytes are row-major, little-endian.
#include <cstdint>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "edgemtp/json.h"
#include "engine_cli.h"

namespace {

using edgemtp::DType;
using edgemtp::json::Array;
using edgemtp::json::Object;
using edgemtp::json::Value;

std::size_t element_count(const std::vector<int64_t>& shape) {
  std::size_t n = 1;
  for (int64_t d : shape) n *= static_cast<std::size_t>(d);
  return n;
}

class PipeRunner : public edgemtp::MethodRunner {
 public:
  std::vector<edgemtp::Tensor> run(const std::string& method,
                                   const std::vector<edgemtp::TensorView>& inputs) override {
    Array specs;
    for (const edgemtp::TensorView& in : inputs) {
      Array shape(in.shape.begin(), in.shape.end());
      specs.emplace_back(Object{{"name", Value(in.name)},
                                {"dtype", Value(in.dtype == DType::kFloat32 ? "float32" : "int64")},
                                {"shape", Value(std::move(shape))}});
    }
    const Value request(Object{{"method", Value(method)}, {"inputs", Value(specs)}});
    std::cout << "CALL " << request.dump() << "\n";
    for (const edgemtp::TensorView& in : inputs) {
      const std::size_t width = in.dtype == DType::kFloat32 ? 4 : 8;
      std::cout.write(static_cast<const char*>(in.data),
                      static_cast<std::streamsize>(element_count(in.shape) * width));
    }
    std::cout.flush();

    std::string line;
    if (!std::getline(std::cin, line)) throw edgemtp::Error(method + ": the pipe closed");
    const Value reply = Value::parse(line);
    if (const Value* error = reply.find("error")) throw edgemtp::Error(error->as_string());
    std::vector<edgemtp::Tensor> out;
    for (const Value& spec : reply["outputs"].as_array()) {
      edgemtp::Tensor t;
      t.name = spec["name"].as_string();
      for (const Value& d : spec["shape"].as_array()) t.shape.push_back(d.as_int());
      const std::size_t n = element_count(t.shape);
      if (spec["dtype"].as_string() == "float32") {
        t.dtype = DType::kFloat32;
        t.f32.resize(n);
        std::cin.read(reinterpret_cast<char*>(t.f32.data()), static_cast<std::streamsize>(n * 4));
      } else {
        t.dtype = DType::kInt64;
        t.i64.resize(n);
        std::cin.read(reinterpret_cast<char*>(t.i64.data()), static_cast<std::streamsize>(n * 8));
      }
      if (!std::cin) throw edgemtp::Error(method + ": the pipe closed mid-reply");
      out.push_back(std::move(t));
    }
    return out;
  }
};

}  // namespace

int main(int argc, char** argv) {
  return edgemtp::run_engine_cli(argc, argv, "engine_pipe",
                                 [](const std::string&, const edgemtp::BundleConfig&) {
                                   return std::make_unique<PipeRunner>();
                                 });
}
