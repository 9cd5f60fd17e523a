#include "CoreMLPlan.h"

#include <cstring>
#include <limits>
#include <set>

namespace edgemtp::ios {

namespace {

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

std::vector<std::string> name_list(const json::Value& io, const char* key,
                                   const std::string& where) {
  const json::Value* list = io.is_object() ? io.find(key) : nullptr;
  if (list == nullptr || !list->is_array()) {
    throw Error("manifest: " + where + "." + key + " must list the function's " + key);
  }
  std::vector<std::string> names;
  for (const json::Value& name : list->as_array()) {
    if (!name.is_string() || name.as_string().empty()) {
      throw Error("manifest: " + where + "." + key + " must hold names");
    }
    names.push_back(name.as_string());
  }
  return names;
}

float bits_to_float(uint32_t bits) {
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

std::size_t element_size(ElementType type) {
  switch (type) {
    case ElementType::kFloat16: return 2;
    case ElementType::kFloat32: return 4;
    case ElementType::kFloat64: return 8;
    case ElementType::kInt32: return 4;
  }
  return 8;
}

template <class In, class Out, class Convert>
void gather(const In* base, const std::vector<int64_t>& shape, const std::vector<int64_t>& strides,
            std::vector<Out>& out, Convert convert) {
  const int64_t n = element_count(shape);
  out.resize(static_cast<std::size_t>(n));
  if (n == 0) return;
  std::vector<int64_t> index(shape.size(), 0);
  int64_t offset = 0;  // of `index`, in elements
  for (std::size_t i = 0; i < out.size(); ++i) {
    out[i] = convert(base[offset]);
    // Advance the row-major index: the last axis fastest.
    for (std::size_t axis = shape.size(); axis-- > 0;) {
      offset += strides[axis];
      if (++index[axis] < shape[axis]) break;
      offset -= strides[axis] * shape[axis];
      index[axis] = 0;
    }
  }
}

}  // namespace

ComputeUnits compute_units_for(const std::string& delegate) {
  if (delegate == "cpu") return ComputeUnits::kCpuOnly;
  if (delegate == "metal") return ComputeUnits::kCpuAndGpu;
  if (delegate == "npu") return ComputeUnits::kCpuAndNeuralEngine;
  if (delegate == "htp") {
    throw Error("Core ML has no Qualcomm delegate: export the bundle with --backend coreml "
                "--delegate npu (or metal, cpu) for this app");
  }
  throw Error("unknown delegate '" + delegate + "' for Core ML (choose cpu, metal, npu)");
}

const char* compute_units_name(ComputeUnits units) {
  switch (units) {
    case ComputeUnits::kCpuOnly: return "CPU_ONLY";
    case ComputeUnits::kCpuAndGpu: return "CPU_AND_GPU";
    case ComputeUnits::kCpuAndNeuralEngine: return "CPU_AND_NE";
  }
  return "CPU_ONLY";
}

CoreMLPlan CoreMLPlan::from_manifest(const json::Value& manifest) {
  const BundleConfig config = BundleConfig::from_manifest(manifest);
  if (config.backend != "coreml") {
    throw Error("manifest: this is a " + config.backend + " bundle and this app runs Core ML: "
                "export it with --backend coreml --delegate npu (or metal, cpu)");
  }
  CoreMLPlan plan;
  plan.program = config.program;
  if (plan.program.empty() || plan.program.front() == '/' ||
      plan.program.find("..") != std::string::npos) {
    throw Error("manifest: program '" + plan.program + "' must name the package inside the bundle");
  }
  plan.delegate = config.delegate;
  plan.units = compute_units_for(config.delegate);

  const json::Value* method_io = manifest.find("method_io");
  if (method_io == nullptr || !method_io->is_object() || method_io->size() == 0) {
    throw Error("manifest: method_io must name the package's functions and their I/O; export "
                "the bundle again");
  }
  for (const auto& [method, io] : method_io->as_object()) {
    const std::string where = "method_io." + method;
    plan.functions[method] = {name_list(io, "inputs", where), name_list(io, "outputs", where)};
  }
  return plan;
}

const FunctionIO& CoreMLPlan::function(const std::string& method) const {
  auto found = functions.find(method);
  if (found == functions.end()) {
    std::vector<std::string> names;
    for (const auto& entry : functions) names.push_back(entry.first);
    throw Error(program + " has no function '" + method + "' (it has " + joined(names) + ")");
  }
  return found->second;
}

std::vector<const TensorView*> bind_inputs(const std::string& method, const FunctionIO& io,
                                           const std::vector<TensorView>& given) {
  std::map<std::string, const TensorView*> by_name;
  for (const TensorView& view : given) {
    if (!by_name.emplace(view.name, &view).second) {
      throw Error(method + ": the engine gave input '" + view.name + "' twice");
    }
  }
  const std::set<std::string> declared(io.inputs.begin(), io.inputs.end());
  for (const auto& entry : by_name) {
    if (!declared.count(entry.first)) {
      throw Error(method + ": the engine gave input '" + entry.first + "', which the function "
                  "does not declare (it takes " + joined(io.inputs) + ")");
    }
  }
  std::vector<const TensorView*> bound;
  for (const std::string& name : io.inputs) {
    auto found = by_name.find(name);
    if (found == by_name.end()) {
      throw Error(method + ": the engine gave no input '" + name + "'");
    }
    bound.push_back(found->second);
  }
  return bound;
}

int64_t element_count(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::vector<int32_t> narrow_to_int32(const TensorView& view) {
  if (view.dtype != DType::kInt64) {
    throw Error("input '" + view.name + "' is float and the package takes int32");
  }
  const auto* values = static_cast<const int64_t*>(view.data);
  std::vector<int32_t> out(static_cast<std::size_t>(element_count(view.shape)));
  for (std::size_t i = 0; i < out.size(); ++i) {
    const int64_t v = values[i];
    if (v < std::numeric_limits<int32_t>::min() || v > std::numeric_limits<int32_t>::max()) {
      throw Error("input '" + view.name + "' holds " + std::to_string(v) +
                  ", beyond the package's int32");
    }
    out[i] = static_cast<int32_t>(v);
  }
  return out;
}

// binary16: a sign bit, 5 exponent bits (bias 15), 10 fraction bits.
float half_to_float(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu;
  uint32_t fraction = bits & 0x3ffu;
  if (exponent == 0x1fu) return bits_to_float(sign | 0x7f800000u | (fraction << 13));  // inf, NaN
  if (exponent != 0) return bits_to_float(sign | ((exponent + 112u) << 23) | (fraction << 13));
  if (fraction == 0) return bits_to_float(sign);  // signed zero
  // Subnormal: shift the fraction up until its leading 1 is the implicit bit.
  uint32_t e = 113;
  while ((fraction & 0x400u) == 0) {
    fraction <<= 1;
    --e;
  }
  return bits_to_float(sign | (e << 23) | ((fraction & 0x3ffu) << 13));
}

Tensor read_output(const std::string& name, ElementType type, const std::vector<int64_t>& shape,
                   const std::vector<int64_t>& strides, const void* data, std::size_t bytes) {
  const std::string bad = "output '" + name + "': Core ML's layout does not fit its buffer";
  if (strides.size() != shape.size()) throw Error(bad);
  int64_t last = 0;  // the offset of the last element, in elements
  for (std::size_t axis = 0; axis < shape.size(); ++axis) {
    if (shape[axis] < 0 || strides[axis] < 0) throw Error(bad);
    if (shape[axis] > 0) last += (shape[axis] - 1) * strides[axis];
  }
  if (element_count(shape) > 0 &&
      static_cast<std::size_t>(last + 1) * element_size(type) > bytes) {
    throw Error(bad);
  }
  Tensor t;
  t.name = name;
  t.shape = shape;
  switch (type) {
    case ElementType::kFloat16:
      t.dtype = DType::kFloat32;
      gather(static_cast<const uint16_t*>(data), shape, strides, t.f32, half_to_float);
      break;
    case ElementType::kFloat32:
      t.dtype = DType::kFloat32;
      gather(static_cast<const float*>(data), shape, strides, t.f32, [](float x) { return x; });
      break;
    case ElementType::kFloat64:
      t.dtype = DType::kFloat32;
      gather(static_cast<const double*>(data), shape, strides, t.f32,
             [](double x) { return static_cast<float>(x); });
      break;
    case ElementType::kInt32:
      t.dtype = DType::kInt64;
      gather(static_cast<const int32_t*>(data), shape, strides, t.i64,
             [](int32_t x) { return static_cast<int64_t>(x); });
      break;
  }
  return t;
}

}  // namespace edgemtp::ios
