// engine_run: an edgemtp::Engine over ExecuTorch's C++ runtime, from the command line (the
// options and the JSON it prints: engine_cli.cpp), with the runner built as the Android app
// builds it. `--separate-arenas` gives each method its own memory arena, as a Module built
// without share_memory_arenas does: what a test shows goes wrong without it.
#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "engine_cli.h"
#include "executorch_runner.h"

int main(int argc, char** argv) {
  edgemtp::ExecuTorchOptions options;
  std::vector<char*> args(argv, argv + argc);
  const auto flag = std::find_if(args.begin() + 1, args.end(), [](const char* arg) {
    return std::strcmp(arg, "--separate-arenas") == 0;
  });
  if (flag != args.end()) {
    options.share_memory_arenas = false;
    args.erase(flag);
  }
  return edgemtp::run_engine_cli(
      static_cast<int>(args.size()), args.data(), "engine_run",
      [&options](const std::string& dir, const edgemtp::BundleConfig& bundle) {
        if (bundle.backend != "executorch") {
          throw edgemtp::Error(dir + " is a " + bundle.backend +
                               " bundle; engine_run runs ExecuTorch bundles");
        }
        return std::make_unique<edgemtp::ExecuTorchRunner>(dir + "/" + bundle.program, options);
      });
}
