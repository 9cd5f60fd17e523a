// edgemtp::MethodRunner over ExecuTorch's C++ runtime (extension::Module): the methods of a
// bundle's model.pte, all sharing the program's cache buffers. The Android app's runner is the
// same code behind JNI.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "edgemtp/engine.h"

namespace executorch::extension::module {
class Module;
}

namespace edgemtp {

class ExecuTorchRunner : public MethodRunner {
 public:
  // Loads `program` (a .pte) and every method in it. Throws Error, one line, when it cannot.
  explicit ExecuTorchRunner(const std::string& program);
  ~ExecuTorchRunner() override;

  std::vector<Tensor> run(const std::string& method,
                          const std::vector<TensorView>& inputs) override;

 private:
  std::string program_;
  std::unique_ptr<executorch::extension::module::Module> module_;
};

}  // namespace edgemtp
