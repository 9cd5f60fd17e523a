// The shared command line of the engine test programs (engine_cli.cpp documents it): each
// program only says how to make the MethodRunner for a bundle.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "edgemtp/engine.h"

namespace edgemtp {

using RunnerFactory = std::function<std::unique_ptr<MethodRunner>(
    const std::string& bundle_dir, const BundleConfig& bundle)>;

// Parses argv, runs the generations and prints the JSON line; returns the exit status.
int run_engine_cli(int argc, char** argv, const std::string& name,
                   const RunnerFactory& make_runner);

}  // namespace edgemtp
