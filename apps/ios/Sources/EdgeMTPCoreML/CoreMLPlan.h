// The platform-free half of the Core ML method runner, in plain C++17 so that it is built and
// tested on any host (tests/test_apps_ios.py): what the runner reads from a bundle's manifest,
// how the engine's inputs map onto a function's inputs, and how a Core ML output of any layout
// becomes the engine's dense Tensor. CoreMLRunner.mm adds only the Core ML calls.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "edgemtp/engine.h"
#include "edgemtp/json.h"

namespace edgemtp::ios {

// MLComputeUnits a bundle's delegate asks for: runtime/capabilities.py's COREML_COMPUTE_UNITS.
enum class ComputeUnits { kCpuOnly, kCpuAndGpu, kCpuAndNeuralEngine };

// cpu -> CPU_ONLY, metal -> CPU_AND_GPU, npu -> CPU_AND_NE. Throws Error for htp (Core ML has
// no Qualcomm delegate) and for any other name.
ComputeUnits compute_units_for(const std::string& delegate);
// coremltools' ct.ComputeUnit name ("CPU_AND_NE"), as the manifest's backend_details spell it.
const char* compute_units_name(ComputeUnits units);

// One function of the package: its inputs and outputs by name, in declaration order.
struct FunctionIO {
  std::vector<std::string> inputs;
  std::vector<std::string> outputs;
};

// What the runner needs from manifest.json. Every name comes from the manifest: the functions
// are method_io's keys (one Core ML function per method), their I/O method_io's lists.
struct CoreMLPlan {
  std::string program;   // the package, relative to the bundle ("model.mlpackage")
  std::string delegate;  // "cpu", "metal" or "npu"
  ComputeUnits units = ComputeUnits::kCpuOnly;
  std::map<std::string, FunctionIO> functions;

  // Refuses, with one Error line, a manifest the core refuses (BundleConfig::from_manifest), a
  // bundle of another backend, a program path that leaves the bundle, and a method_io that
  // does not list each function's inputs and outputs as names.
  static CoreMLPlan from_manifest(const json::Value& manifest);

  // The function of `method`; Error naming the method and the functions there are.
  const FunctionIO& function(const std::string& method) const;
};

// The engine's tensor for each of io.inputs, in the function's order. Throws Error naming an
// input the function needs and the engine did not give, or one the engine gave that the
// function does not declare (a manifest that disagrees with the program).
std::vector<const TensorView*> bind_inputs(const std::string& method, const FunctionIO& io,
                                           const std::vector<TensorView>& given);

int64_t element_count(const std::vector<int64_t>& shape);

// The engine's int64 elements as the package's int32 (positions, slot positions). Throws Error
// naming the input when a value does not fit.
std::vector<int32_t> narrow_to_int32(const TensorView& view);

// IEEE 754 binary16 bits to float (exact: every half is a float).
float half_to_float(uint16_t bits);

// The element types a Core ML output can have here.
enum class ElementType { kFloat16, kFloat32, kFloat64, kInt32 };

// A Core ML output as the engine's Tensor: dense, row-major, floats as float32 and integers as
// int64. `strides` are in elements, as MLMultiArray gives them (the Neural Engine may pad rows);
// `bytes` is the buffer's size. Throws Error when the layout does not fit the buffer.
Tensor read_output(const std::string& name, ElementType type, const std::vector<int64_t>& shape,
                   const std::vector<int64_t>& strides, const void* data, std::size_t bytes);

}  // namespace edgemtp::ios
