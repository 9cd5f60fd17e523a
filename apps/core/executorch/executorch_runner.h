// edgemtp::MethodRunner over ExecuTorch's C++ runtime (extension::Module): the methods of a
// bundle's model.pte, all sharing the program's cache buffers. The Android app (through JNI) and
// the host's engine_run construct it the same way; no ExecuTorch header is needed to include
// this one.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "edgemtp/engine.h"

namespace executorch::extension::module {
class Module;
}

namespace edgemtp {

struct ExecuTorchOptions {
  // Threads of ExecuTorch's shared pool (XNNPACK and edgemtp's kernels); 0 keeps its default
  // (the performance cores). Only where the runtime's threadpool header is available.
  int threads = 0;
  // Every method sees the same mutable buffers (the KV cache): bundles are exported with
  // share_mutable_buffers, and without this each method gets its own empty cache, so verify
  // and draft never see what prefill wrote. False only to show that (tests).
  bool share_memory_arenas = true;
};

class ExecuTorchRunner : public MethodRunner {
 public:
  // Loads `program` (a .pte) and every method in it. Throws Error, one line, when it cannot.
  explicit ExecuTorchRunner(const std::string& program, const ExecuTorchOptions& options = {});
  ~ExecuTorchRunner() override;

  std::vector<Tensor> run(const std::string& method,
                          const std::vector<TensorView>& inputs) override;

 private:
  std::string program_;
  std::unique_ptr<executorch::extension::module::Module> module_;
};

}  // namespace edgemtp
