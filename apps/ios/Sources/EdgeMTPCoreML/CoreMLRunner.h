// The core's MethodRunner on Core ML: one MLModel per function of the bundle's multifunction
// package, every prediction on the one MLState that holds the K/V caches (export/coreml.py).
// Objective-C++; include it only from .mm files.
#pragma once

#import <CoreML/CoreML.h>

#include <set>
#include <string>
#include <vector>

#include "CoreMLPlan.h"

namespace edgemtp::ios {

// Core ML would not let one function run on the MLState another function made, or a function
// ran but its cache writes did not reach that state. Every function of the package declares the
// same states, but whether Core ML shares one MLState across functions is unverified off-device
// (export/coreml.py); this is how the app says so when a device disagrees.
class SharedStateError : public Error {
 public:
  using Error::Error;
};

class CoreMLRunner final : public MethodRunner {
 public:
  // Compiles the bundle's package into `compiled_cache` the first time (named by `bundle_key`,
  // the manifest's SHA-256), loads each function with the plan's compute units, checks their
  // I/O against the plan and that they declare the same states, and makes the shared MLState.
  // Throws Error naming what failed.
  CoreMLRunner(NSURL* bundle, CoreMLPlan plan, NSURL* compiled_cache, const std::string& bundle_key);

  std::vector<Tensor> run(const std::string& method, const std::vector<TensorView>& inputs) override;

  const CoreMLPlan& plan() const { return plan_; }

 private:
  std::vector<Tensor> predict(const std::string& method, const std::vector<TensorView>& inputs);
  id<MLFeatureProvider> predict_on_shared_state(const std::string& method, MLModel* model,
                                                id<MLFeatureProvider> features);
  uint64_t state_fingerprint() const;

  CoreMLPlan plan_;
  NSDictionary<NSString*, MLModel*>* functions_ = nil;
  MLState* state_ = nil;
  std::string state_owner_;     // the function whose MLModel made state_
  NSString* probe_state_ = nil;  // the state buffer fingerprinted to see writes land
  std::set<std::string> sharing_checked_;
};

}  // namespace edgemtp::ios
