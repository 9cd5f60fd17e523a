// The Core ML runner's platform-free half (Sources/EdgeMTPCoreML/CoreMLPlan.*) driven from the
// command line, so that tests/test_apps_ios.py can check it on a host without Apple's SDKs.
//
//   coreml_plan_check plan MANIFEST              what the runner reads from a manifest (JSON)
//   coreml_plan_check bind MANIFEST METHOD NAME...  the engine's inputs in the function's order
//   coreml_plan_check read TYPE SHAPE STRIDES FILE  a Core ML output buffer as the engine's tensor
//   coreml_plan_check narrow VALUE...            int64 values as the package's int32
//
// TYPE is f16, f32, f64 or i32; SHAPE and STRIDES are comma-separated (in elements). A refusal
// prints "error: <message>" and exits 1.
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "CoreMLPlan.h"

using edgemtp::json::Array;
using edgemtp::json::Object;
using edgemtp::json::Value;
namespace ios = edgemtp::ios;

namespace {

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw edgemtp::Error("cannot read " + path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::vector<int64_t> int_list(const std::string& text) {
  std::vector<int64_t> out;
  std::stringstream in(text);
  for (std::string part; std::getline(in, part, ',');) {
    if (!part.empty()) out.push_back(std::stoll(part));
  }
  return out;
}

Value names(const std::vector<std::string>& list) {
  Array out;
  for (const std::string& n : list) out.emplace_back(n);
  return out;
}

int print_plan(const std::string& manifest_path) {
  const auto p = ios::CoreMLPlan::from_manifest(Value::parse(read_text(manifest_path)));
  Object functions;
  for (const auto& [method, io] : p.functions) {
    functions[method] = Object{{"inputs", names(io.inputs)}, {"outputs", names(io.outputs)}};
  }
  std::cout << Value(Object{{"program", p.program},
                            {"delegate", p.delegate},
                            {"compute_units", ios::compute_units_name(p.units)},
                            {"functions", functions}})
                   .dump()
            << "\n";
  return 0;
}

int print_binding(const std::string& manifest_path, const std::string& method,
         const std::vector<std::string>& given_names) {
  const auto p = ios::CoreMLPlan::from_manifest(Value::parse(read_text(manifest_path)));
  std::vector<edgemtp::TensorView> given;
  for (const std::string& n : given_names) given.push_back({n, edgemtp::DType::kFloat32, {1}, nullptr});
  Array order;
  for (const edgemtp::TensorView* view : ios::bind_inputs(method, p.function(method), given)) {
    order.emplace_back(view->name);
  }
  std::cout << Value(order).dump() << "\n";
  return 0;
}

int print_output(const std::string& type_name, const std::string& shape, const std::string& strides,
         const std::string& path) {
  const ios::ElementType type = type_name == "f16"   ? ios::ElementType::kFloat16
                                : type_name == "f32" ? ios::ElementType::kFloat32
                                : type_name == "f64" ? ios::ElementType::kFloat64
                                                     : ios::ElementType::kInt32;
  const std::string bytes = read_text(path);
  const edgemtp::Tensor t = ios::read_output("out", type, int_list(shape), int_list(strides),
                                             bytes.data(), bytes.size());
  Array values;
  if (t.dtype == edgemtp::DType::kFloat32) {
    for (float v : t.f32) values.emplace_back(static_cast<double>(v));
  } else {
    for (int64_t v : t.i64) values.emplace_back(v);
  }
  Array dims;
  for (int64_t d : t.shape) dims.emplace_back(d);
  std::cout << Value(Object{{"dtype", t.dtype == edgemtp::DType::kFloat32 ? "float32" : "int64"},
                            {"shape", dims},
                            {"values", values}})
                   .dump()
            << "\n";
  return 0;
}

int print_narrowed(const std::vector<std::string>& args) {
  std::vector<int64_t> values;
  for (const std::string& a : args) values.push_back(std::stoll(a));
  const edgemtp::TensorView view{"positions", edgemtp::DType::kInt64,
                                 {static_cast<int64_t>(values.size())}, values.data()};
  Array out;
  for (int32_t v : ios::narrow_to_int32(view)) out.emplace_back(static_cast<int64_t>(v));
  std::cout << Value(out).dump() << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  try {
    if (args.size() == 2 && args[0] == "plan") return print_plan(args[1]);
    if (args.size() >= 3 && args[0] == "bind") {
      return print_binding(args[1], args[2], std::vector<std::string>(args.begin() + 3, args.end()));
    }
    if (args.size() == 5 && args[0] == "read") return print_output(args[1], args[2], args[3], args[4]);
    if (!args.empty() && args[0] == "narrow") {
      return print_narrowed(std::vector<std::string>(args.begin() + 1, args.end()));
    }
  } catch (const std::exception& e) {
    std::cout << "error: " << e.what() << "\n";
    return 1;
  }
  std::cerr << "usage: coreml_plan_check plan|bind|read|narrow ... (see the source)\n";
  return 2;
}
