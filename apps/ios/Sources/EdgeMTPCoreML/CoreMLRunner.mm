#import "CoreMLRunner.h"

#if !__has_feature(objc_arc)
#error "CoreMLRunner.mm is written for ARC (SwiftPM and Xcode turn it on for packages)"
#endif

#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <utility>

#import "EMBridging.h"

namespace edgemtp::ios {

namespace {

using StateShapes = std::map<std::string, std::vector<int64_t>>;

std::string describe(NSError* error) {
  return error == nil ? "no reason given" : em_std(error.localizedDescription);
}

MLComputeUnits ml_compute_units(ComputeUnits units) {
  switch (units) {
    case ComputeUnits::kCpuOnly: return MLComputeUnitsCPUOnly;
    case ComputeUnits::kCpuAndGpu: return MLComputeUnitsCPUAndGPU;
    case ComputeUnits::kCpuAndNeuralEngine: return MLComputeUnitsCPUAndNeuralEngine;
  }
  return MLComputeUnitsCPUOnly;
}

std::vector<int64_t> int_list(NSArray<NSNumber*>* numbers) {
  std::vector<int64_t> out;
  for (NSNumber* n in numbers) out.push_back(n.longLongValue);
  return out;
}

NSArray<NSNumber*>* contiguous_strides(NSArray<NSNumber*>* shape) {
  NSMutableArray<NSNumber*>* strides = [NSMutableArray arrayWithCapacity:shape.count];
  long long stride = 1;
  for (NSUInteger axis = shape.count; axis-- > 0;) {
    [strides insertObject:@(stride) atIndex:0];
    stride *= shape[axis].longLongValue;
  }
  return strides;
}

// Compiling a large package takes a while, so it is done once per bundle (keyed by the
// manifest's SHA-256) into the app's caches; the system may purge them, and then it is redone.
NSURL* compiled_location(NSURL* cache, const std::string& key) {
  return [cache URLByAppendingPathComponent:[em_ns(key) stringByAppendingPathExtension:@"mlmodelc"]
                                isDirectory:YES];
}

NSURL* compile_package(NSURL* package, NSURL* cache, const std::string& key) {
  NSFileManager* files = NSFileManager.defaultManager;
  NSURL* target = compiled_location(cache, key);
  [files removeItemAtURL:target error:nil];
  NSError* error = nil;
  if (![files createDirectoryAtURL:cache withIntermediateDirectories:YES attributes:nil error:&error]) {
    throw Error("cannot create " + em_std(cache.path) + ": " + describe(error));
  }
  __block NSURL* compiled = nil;
  __block NSError* compile_error = nil;
  dispatch_semaphore_t done = dispatch_semaphore_create(0);
  [MLModel compileModelAtURL:package
           completionHandler:^(NSURL* _Nullable url, NSError* _Nullable failure) {
             compiled = url;
             compile_error = failure;
             dispatch_semaphore_signal(done);
           }];
  dispatch_semaphore_wait(done, DISPATCH_TIME_FOREVER);
  if (compiled == nil) {
    throw Error("Core ML cannot compile " + em_std(package.lastPathComponent) + ": " +
                describe(compile_error) + " (it needs iOS 18 / macOS 15; export the bundle again "
                "if it persists)");
  }
  if (![files moveItemAtURL:compiled toURL:target error:&error]) {
    throw Error("cannot keep the compiled model at " + em_std(target.path) + ": " + describe(error));
  }
  return target;
}

void check_io(const std::string& method, const FunctionIO& io, MLModelDescription* description) {
  NSDictionary<NSString*, MLFeatureDescription*>* inputs = description.inputDescriptionsByName;
  NSDictionary<NSString*, MLFeatureDescription*>* outputs = description.outputDescriptionsByName;
  const std::string fix = ": the manifest does not match its package; export the bundle again";
  for (const std::string& name : io.inputs) {
    if (inputs[em_ns(name)] == nil) throw Error(method + " has no input '" + name + "'" + fix);
  }
  if (inputs.count != io.inputs.size()) {
    throw Error(method + " takes inputs the manifest's method_io does not list" + fix);
  }
  for (const std::string& name : io.outputs) {
    if (outputs[em_ns(name)] == nil) throw Error(method + " has no output '" + name + "'" + fix);
  }
}

StateShapes state_shapes(MLModelDescription* description) {
  __block StateShapes shapes;
  [description.stateDescriptionsByName
      enumerateKeysAndObjectsUsingBlock:^(NSString* name, MLFeatureDescription* state, BOOL*) {
        shapes[em_std(name)] = int_list(state.stateConstraint.bufferShape);
      }];
  return shapes;
}

MLMultiArray* input_array(const std::string& method, const TensorView& view,
                          MLFeatureDescription* description) {
  MLMultiArrayConstraint* constraint = description.multiArrayConstraint;
  const std::string where = method + " input '" + view.name + "'";
  if (constraint == nil) throw Error(where + " is not an array in the package");
  NSArray<NSNumber*>* shape = constraint.shape;
  const int64_t expected = element_count(int_list(shape));
  if (element_count(view.shape) != expected) {
    throw Error(where + " has " + std::to_string(element_count(view.shape)) +
                " elements, the package's function takes " + std::to_string(expected));
  }
  NSError* error = nil;
  MLMultiArray* array = nil;
  switch (constraint.dataType) {
    case MLMultiArrayDataTypeFloat32:
      if (view.dtype != DType::kFloat32) throw Error(where + " is int64, the package takes float32");
      // The engine's own buffer, without a copy: it stays valid until run() returns.
      array = [[MLMultiArray alloc] initWithDataPointer:const_cast<void*>(view.data)
                                                  shape:shape
                                               dataType:MLMultiArrayDataTypeFloat32
                                                strides:contiguous_strides(shape)
                                            deallocator:nil
                                                  error:&error];
      break;
    case MLMultiArrayDataTypeInt32: {
      const std::vector<int32_t> values = narrow_to_int32(view);
      const std::size_t bytes = values.size() * sizeof(int32_t);
      void* copy = std::malloc(bytes > 0 ? bytes : 1);
      if (copy == nullptr) throw Error(where + ": out of memory");
      std::memcpy(copy, values.data(), bytes);
      array = [[MLMultiArray alloc] initWithDataPointer:copy
                                                  shape:shape
                                               dataType:MLMultiArrayDataTypeInt32
                                                strides:contiguous_strides(shape)
                                            deallocator:^(void* owned) { std::free(owned); }
                                                  error:&error];
      break;
    }
    default:
      throw Error(where + " has a data type this runner does not feed (export/coreml.py declares "
                          "float32 and int32 inputs)");
  }
  if (array == nil) throw Error(where + ": " + describe(error));
  return array;
}

ElementType element_type(MLMultiArrayDataType type, const std::string& where) {
  switch (type) {
    case MLMultiArrayDataTypeFloat16: return ElementType::kFloat16;
    case MLMultiArrayDataTypeFloat32: return ElementType::kFloat32;
    case MLMultiArrayDataTypeDouble: return ElementType::kFloat64;
    case MLMultiArrayDataTypeInt32: return ElementType::kInt32;
    default: throw Error(where + " has a data type this runner cannot read");
  }
}

Tensor output_tensor(const std::string& method, const std::string& name, MLMultiArray* array) {
  const std::string where = method + " output '" + name + "'";
  const ElementType type = element_type(array.dataType, where);
  const std::vector<int64_t> shape = int_list(array.shape);
  const std::vector<int64_t> strides = int_list(array.strides);
  __block Tensor tensor;
  __block std::exception_ptr failure;
  // No C++ exception may unwind through Core ML's frames: it is caught here and rethrown below.
  [array getBytesWithHandler:^(const void* bytes, NSInteger size) {
    try {
      tensor = read_output(name, type, shape, strides, bytes, static_cast<std::size_t>(size));
    } catch (...) {
      failure = std::current_exception();
    }
  }];
  if (failure) std::rethrow_exception(failure);
  return tensor;
}

bool writes_cache(const FunctionIO& io) {
  // export/coreml.py's calling protocol: a function that writes the cache returns new_pos_<kind>.
  for (const std::string& name : io.outputs) {
    if (name.rfind("new_pos_", 0) == 0) return true;
  }
  return false;
}

std::string shared_state_refused(const std::string& method, const std::string& owner,
                                 const std::string& why) {
  return "Core ML would not run " + method + " on the MLState that " + owner + " made (" + why +
         "). The bundle's functions share the K/V cache through one MLState, which edgemtp could "
         "not verify off-device (export/coreml.py); this device and OS do not allow it. Please "
         "report it with the device model and OS version.";
}

}  // namespace

CoreMLRunner::CoreMLRunner(NSURL* bundle, CoreMLPlan plan, NSURL* compiled_cache,
                           const std::string& bundle_key)
    : plan_(std::move(plan)) {
  NSURL* package = [bundle URLByAppendingPathComponent:em_ns(plan_.program)];
  if (![NSFileManager.defaultManager fileExistsAtPath:package.path]) {
    throw Error(plan_.program + " is missing from " + em_std(bundle.lastPathComponent) +
                ": copy the whole bundle folder");
  }
  const auto load = [&](NSURL* compiled) {
    NSMutableDictionary<NSString*, MLModel*>* functions = [NSMutableDictionary dictionary];
    StateShapes states;
    std::string states_of;
    for (const auto& [method, io] : plan_.functions) {
      MLModelConfiguration* configuration = [[MLModelConfiguration alloc] init];
      configuration.computeUnits = ml_compute_units(plan_.units);
      configuration.functionName = em_ns(method);
      NSError* error = nil;
      MLModel* model = [MLModel modelWithContentsOfURL:compiled configuration:configuration error:&error];
      if (model == nil) {
        throw Error("Core ML cannot load function " + method + " of " + plan_.program + " for " +
                    compute_units_name(plan_.units) + ": " + describe(error));
      }
      check_io(method, io, model.modelDescription);
      StateShapes declared = state_shapes(model.modelDescription);
      if (functions.count == 0) {
        states = declared;
        states_of = method;
      } else if (declared != states) {
        throw Error(method + " and " + states_of + " declare different states, so they cannot "
                    "share the cache: export the bundle again");
      }
      functions[em_ns(method)] = model;
    }
    functions_ = [functions copy];
    probe_state_ = states.empty() ? nil : em_ns(states.begin()->first);
  };
  NSURL* cached = compiled_location(compiled_cache, bundle_key);
  bool loaded = false;
  if ([NSFileManager.defaultManager fileExistsAtPath:cached.path]) {
    try {
      load(cached);
      loaded = true;
    } catch (const Error&) {
      // A copy compiled by an older OS may no longer load: compile it afresh below.
    }
  }
  if (!loaded) load(compile_package(package, compiled_cache, bundle_key));
  // One state for every function: the drafter reads the cache the target writes. Core ML
  // zero-fills a new state, so masked slots hold finite values (export/coreml.py's runner
  // writes the zeros itself).
  state_owner_ = plan_.functions.begin()->first;
  state_ = [functions_[em_ns(state_owner_)] newState];
}

std::vector<Tensor> CoreMLRunner::run(const std::string& method,
                                      const std::vector<TensorView>& inputs) {
  std::vector<Tensor> outputs;
  std::exception_ptr failure;
  @autoreleasepool {
    try {
      @try {
        outputs = predict(method, inputs);
      } @catch (NSException* exception) {
        throw Error(method + ": Core ML raised " + em_std(exception.name) + ": " +
                    em_std(exception.reason));
      }
    } catch (...) {
      failure = std::current_exception();  // thrown after the pool drains
    }
  }
  if (failure) std::rethrow_exception(failure);
  return outputs;
}

std::vector<Tensor> CoreMLRunner::predict(const std::string& method,
                                          const std::vector<TensorView>& inputs) {
  const FunctionIO& io = plan_.function(method);
  MLModel* model = functions_[em_ns(method)];
  const std::vector<const TensorView*> bound = bind_inputs(method, io, inputs);
  NSDictionary<NSString*, MLFeatureDescription*>* described =
      model.modelDescription.inputDescriptionsByName;
  NSMutableDictionary<NSString*, MLFeatureValue*>* features = [NSMutableDictionary dictionary];
  for (std::size_t i = 0; i < bound.size(); ++i) {
    NSString* name = em_ns(io.inputs[i]);
    features[name] =
        [MLFeatureValue featureValueWithMultiArray:input_array(method, *bound[i], described[name])];
  }
  NSError* error = nil;
  MLDictionaryFeatureProvider* provider =
      [[MLDictionaryFeatureProvider alloc] initWithDictionary:features error:&error];
  if (provider == nil) throw Error(method + ": " + describe(error));

  // The first time a function other than the state's maker writes the cache, make sure the
  // write reached the shared state rather than a private copy.
  const bool check = probe_state_ != nil && method != state_owner_ &&
                     sharing_checked_.count(method) == 0 && writes_cache(io);
  const uint64_t before = check ? state_fingerprint() : 0;
  id<MLFeatureProvider> result = predict_on_shared_state(method, model, provider);
  if (check) {
    if (state_fingerprint() == before) {
      throw SharedStateError(shared_state_refused(
          method, state_owner_, "it ran, but its cache writes did not reach the shared state"));
    }
    sharing_checked_.insert(method);
  }

  std::vector<Tensor> outputs;
  for (const std::string& name : io.outputs) {
    MLMultiArray* array = [result featureValueForName:em_ns(name)].multiArrayValue;
    if (array == nil) throw Error(method + ": Core ML returned no array '" + name + "'");
    outputs.push_back(output_tensor(method, name, array));
  }
  return outputs;
}

id<MLFeatureProvider> CoreMLRunner::predict_on_shared_state(const std::string& method, MLModel* model,
                                                            id<MLFeatureProvider> features) {
  NSError* error = nil;
  id<MLFeatureProvider> result = [model predictionFromFeatures:features usingState:state_ error:&error];
  if (result != nil) return result;
  if (method != state_owner_) {
    // Tell a refusal of the shared state from any other failure: the same inputs on a
    // throwaway state of the function's own.
    NSError* own_error = nil;
    if ([model predictionFromFeatures:features usingState:[model newState] error:&own_error] != nil) {
      throw SharedStateError(shared_state_refused(method, state_owner_, describe(error)));
    }
  }
  throw Error(method + ": Core ML prediction failed: " + describe(error));
}

uint64_t CoreMLRunner::state_fingerprint() const {
  __block uint64_t hash = 14695981039346656037ull;  // FNV-1a
  [state_ getMultiArrayForStateNamed:probe_state_
                             handler:^(MLMultiArray* buffer) {
                               [buffer getBytesWithHandler:^(const void* bytes, NSInteger size) {
                                 const auto* p = static_cast<const unsigned char*>(bytes);
                                 for (NSInteger i = 0; i < size; ++i) {
                                   hash = (hash ^ p[i]) * 1099511628211ull;
                                 }
                               }];
                             }];
  return hash;
}

}  // namespace edgemtp::ios
