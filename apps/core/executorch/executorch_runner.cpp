#include "executorch_runner.h"

#include <algorithm>
#include <set>
#include <string>
#include <utility>

#include <executorch/extension/module/module.h>
#include <executorch/extension/tensor/tensor.h>
#include <executorch/runtime/backend/interface.h>
#include <executorch/runtime/backend/options.h>
#if __has_include(<executorch/extension/threadpool/threadpool.h>)
#include <executorch/extension/threadpool/threadpool.h>
#define EDGEMTP_HAS_THREADPOOL 1
#endif

namespace edgemtp {

namespace {

using executorch::aten::ScalarType;
using executorch::extension::module::Module;
using executorch::runtime::EValue;

std::string describe(executorch::runtime::Error error) {
  return std::string(executorch::runtime::to_string(error)) + " (0x" +
         "0123456789abcdef"[(static_cast<int>(error) >> 4) & 0xf] +
         "0123456789abcdef"[static_cast<int>(error) & 0xf] + ")";
}

// XNNPACK's weight cache, as export/driver.py's enable_xnnpack_weight_cache: methods that share
// a weight (every target method shares all of them) then share one packed copy. Process-wide,
// before any method loads; a runtime without the option simply packs per method.
void enable_xnnpack_weight_cache() {
  executorch::runtime::BackendOptions<1> options;
  if (options.set_option("weight_cache_enabled", true) == executorch::runtime::Error::Ok) {
    (void)executorch::runtime::set_option("XnnpackBackend", options.view());
  }
}

}  // namespace

ExecuTorchRunner::ExecuTorchRunner(const std::string& program, const ExecuTorchOptions& options)
    : program_(program) {
  enable_xnnpack_weight_cache();
#ifdef EDGEMTP_HAS_THREADPOOL
  if (options.threads > 0) {
    executorch::extension::threadpool::get_threadpool()->_unsafe_reset_threadpool(
        static_cast<uint32_t>(options.threads));
  }
#endif
  // share_memory_arenas: the program was planned with share_mutable_buffers, so every method
  // must see the same cache buffers (the drafter reads what the target writes).
  module_ = std::make_unique<Module>(program, Module::LoadMode::Mmap, nullptr, nullptr, nullptr,
                                     options.share_memory_arenas);
  if (auto error = module_->load(); error != executorch::runtime::Error::Ok) {
    throw Error(program + ": ExecuTorch cannot load the program: " + describe(error) +
                "; copy the bundle again or export it again");
  }
  auto names = module_->method_names();
  if (!names.ok()) throw Error(program + ": cannot list the program's methods");
  // Load every method now: loading one initialises the shared cache buffers, which would wipe
  // the cache if it happened in the middle of a sequence.
  const std::set<std::string> sorted(names->begin(), names->end());
  for (const std::string& name : sorted) {
    if (auto error = module_->load_method(name); error != executorch::runtime::Error::Ok) {
      throw Error(program + ": ExecuTorch cannot load method '" + name + "': " + describe(error) +
                  " (a program delegated to Core ML or QNN needs that backend's runtime; export "
                  "with --delegate cpu for XNNPACK)");
    }
  }
}

ExecuTorchRunner::~ExecuTorchRunner() = default;

std::vector<Tensor> ExecuTorchRunner::run(const std::string& method,
                                          const std::vector<TensorView>& inputs) {
  std::vector<executorch::extension::TensorPtr> tensors;  // alive until execute returns
  std::vector<EValue> values;
  for (const TensorView& in : inputs) {
    std::vector<executorch::aten::SizesType> sizes(in.shape.begin(), in.shape.end());
    const ScalarType type = in.dtype == DType::kFloat32 ? ScalarType::Float : ScalarType::Long;
    // The runtime only reads inputs; from_blob takes a mutable pointer regardless.
    tensors.push_back(executorch::extension::from_blob(const_cast<void*>(in.data), sizes, type));
    values.emplace_back(*tensors.back());
  }
  auto result = module_->execute(method, values);
  if (!result.ok()) {
    throw Error(method + ": ExecuTorch execution failed: " + describe(result.error()));
  }
  // Copy out at once: with shared arenas the next method may reuse the output memory.
  std::vector<Tensor> out;
  for (std::size_t i = 0; i < result->size(); ++i) {
    const EValue& value = (*result)[i];
    if (!value.isTensor()) {
      throw Error(method + ": output " + std::to_string(i) + " is not a tensor");
    }
    const executorch::aten::Tensor& t = value.toTensor();
    Tensor o;
    o.name = "output" + std::to_string(i);
    o.shape.assign(t.sizes().begin(), t.sizes().end());
    const auto n = static_cast<std::size_t>(t.numel());
    if (t.scalar_type() == ScalarType::Float) {
      o.dtype = DType::kFloat32;
      o.f32.assign(t.const_data_ptr<float>(), t.const_data_ptr<float>() + n);
    } else if (t.scalar_type() == ScalarType::Long) {
      o.dtype = DType::kInt64;
      o.i64.assign(t.const_data_ptr<int64_t>(), t.const_data_ptr<int64_t>() + n);
    } else if (t.scalar_type() == ScalarType::Int) {
      o.dtype = DType::kInt64;
      o.i64.assign(t.const_data_ptr<int32_t>(), t.const_data_ptr<int32_t>() + n);
    } else {
      throw Error(method + ": output " + std::to_string(i) + " has an unsupported dtype (" +
                  std::to_string(static_cast<int>(t.scalar_type())) + ")");
    }
    out.push_back(std::move(o));
  }
  return out;
}

}  // namespace edgemtp
