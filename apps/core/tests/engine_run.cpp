// engine_run: an edgemtp::Engine over ExecuTorch's C++ runtime, from the command line (the
// options and the JSON it prints: engine_cli.cpp).
#include <memory>
#include <string>

#include "engine_cli.h"
#include "executorch_runner.h"

int main(int argc, char** argv) {
  return edgemtp::run_engine_cli(
      argc, argv, "engine_run",
      [](const std::string& dir, const edgemtp::BundleConfig& bundle) {
        if (bundle.backend != "executorch") {
          throw edgemtp::Error(dir + " is a " + bundle.backend +
                               " bundle; engine_run runs ExecuTorch bundles");
        }
        return std::make_unique<edgemtp::ExecuTorchRunner>(dir + "/" + bundle.program);
      });
}
