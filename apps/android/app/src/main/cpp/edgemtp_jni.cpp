// The JNI bridge between the Kotlin app (dev.edgemtp.sample) and the shared decode core
// (apps/core): the native methods of engine.NativeEngine. An ExecuTorch bundle's methods run in
// this library (apps/core/executorch: ExecuTorch's C++ Module with shared memory arenas, and
// edgemtp's kernels); an ONNX bundle's through the Kotlin runner.BundleRunner (ONNX Runtime).
//
// What this file guarantees:
//  - No C++ exception crosses JNI. Every native method body runs in `guarded`, which turns an
//    edgemtp::Error into an engine.EngineException carrying its one-line message and rethrows a
//    Kotlin exception that escaped a callback as itself.
//  - A Java exception raised in a callback is taken (ExceptionClear) before the next JNI call
//    and travels through the core as a JavaException, an edgemtp::Error: the benchmark records
//    it as a failed run like any other runner failure.
//  - Tensors cross as direct ByteBuffers: inputs over engine memory (no copy), outputs over the
//    runner's memory (one memcpy each); no per-element JNI call.
//  - Each callback runs in its own local-reference frame: a generation is one native call that
//    makes thousands of callbacks, and local references live until the native call returns.
//  - Text crosses as UTF-16 (NewString, GetStringRegion): JNI's "modified UTF-8" functions
//    would garble characters outside the Basic Multilingual Plane (emoji, many CJK ideographs).

#include <jni.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "edgemtp/bench.h"
#include "edgemtp/decode.h"
#include "edgemtp/engine.h"
#include "edgemtp/utf8.h"
#include "executorch_runner.h"

namespace {

using edgemtp::DType;

// runner.NativeTensor's dtype codes (NativeTensor.FLOAT32 and NativeTensor.INT64).
constexpr jint kJavaFloat32 = 0;
constexpr jint kJavaInt64 = 1;

JavaVM* g_vm = nullptr;

// The classes and methods the bridge uses, resolved once in JNI_OnLoad: that thread reaches the
// app's class loader, which a later FindClass on another thread might not.
struct JavaApi {
  jclass native_tensor = nullptr;
  jclass generation_stats = nullptr;
  jclass engine_exception = nullptr;
  jclass out_of_memory = nullptr;
  jclass string = nullptr;

  jmethodID runner_run = nullptr;
  jmethodID tensor_init = nullptr;
  jmethodID tensor_name = nullptr;
  jmethodID tensor_dtype = nullptr;
  jmethodID tensor_shape = nullptr;
  jmethodID tensor_data = nullptr;
  jmethodID stats_init = nullptr;
  jmethodID engine_exception_init = nullptr;
  jmethodID generation_on_text = nullptr;
  jmethodID generation_should_stop = nullptr;
  jmethodID bench_battery_reading = nullptr;
  jmethodID bench_on_progress = nullptr;
  jmethodID bench_should_stop = nullptr;
  jmethodID battery_source = nullptr;
  jmethodID battery_value = nullptr;
  jmethodID battery_unit = nullptr;
  jmethodID machine_platform = nullptr;
  jmethodID machine_device = nullptr;
  jmethodID machine_profile = nullptr;
  jmethodID machine_cpu = nullptr;
  jmethodID machine_cores = nullptr;
  jmethodID machine_memory_gib = nullptr;
  jmethodID machine_os = nullptr;
  jmethodID machine_threads = nullptr;
  jmethodID machine_library_names = nullptr;
  jmethodID machine_library_versions = nullptr;
  jmethodID throwable_to_string = nullptr;
};
JavaApi g;

struct ClassRef {
  const char* name;
  jclass* slot;
};

// Classes the bridge instantiates or throws (held as global references).
const ClassRef kClasses[] = {
    {"dev/edgemtp/sample/runner/NativeTensor", &g.native_tensor},
    {"dev/edgemtp/sample/engine/GenerationStats", &g.generation_stats},
    {"dev/edgemtp/sample/engine/EngineException", &g.engine_exception},
    {"java/lang/OutOfMemoryError", &g.out_of_memory},
    {"java/lang/String", &g.string},
};

struct MethodRef {
  const char* class_name;
  const char* name;
  const char* signature;
  jmethodID* slot;
};

// Every Kotlin method the bridge calls; tests/test_apps_android.py checks each against the
// Kotlin sources.
const MethodRef kMethods[] = {
    {"dev/edgemtp/sample/runner/BundleRunner", "run",
     "(Ljava/lang/String;[Ldev/edgemtp/sample/runner/NativeTensor;)"
     "[Ldev/edgemtp/sample/runner/NativeTensor;",
     &g.runner_run},
    {"dev/edgemtp/sample/runner/NativeTensor", "<init>",
     "(Ljava/lang/String;I[JLjava/nio/ByteBuffer;)V", &g.tensor_init},
    {"dev/edgemtp/sample/runner/NativeTensor", "getName", "()Ljava/lang/String;", &g.tensor_name},
    {"dev/edgemtp/sample/runner/NativeTensor", "getDtype", "()I", &g.tensor_dtype},
    {"dev/edgemtp/sample/runner/NativeTensor", "getShape", "()[J", &g.tensor_shape},
    {"dev/edgemtp/sample/runner/NativeTensor", "getData", "()Ljava/nio/ByteBuffer;",
     &g.tensor_data},
    {"dev/edgemtp/sample/engine/GenerationStats", "<init>",
     "(II[ILjava/lang/String;Ljava/lang/String;DDDDD[I[I[Ljava/lang/String;[D)V", &g.stats_init},
    {"dev/edgemtp/sample/engine/EngineException", "<init>", "(Ljava/lang/String;)V",
     &g.engine_exception_init},
    {"dev/edgemtp/sample/engine/GenerationListener", "onText", "(Ljava/lang/String;[I)V",
     &g.generation_on_text},
    {"dev/edgemtp/sample/engine/GenerationListener", "shouldStop", "()Z",
     &g.generation_should_stop},
    {"dev/edgemtp/sample/engine/BenchListener", "batteryReading",
     "()Ldev/edgemtp/sample/engine/BatteryReading;", &g.bench_battery_reading},
    {"dev/edgemtp/sample/engine/BenchListener", "onProgress", "(IILjava/lang/String;)V",
     &g.bench_on_progress},
    {"dev/edgemtp/sample/engine/BenchListener", "shouldStop", "()Z", &g.bench_should_stop},
    {"dev/edgemtp/sample/engine/BatteryReading", "getSource", "()Ljava/lang/String;",
     &g.battery_source},
    {"dev/edgemtp/sample/engine/BatteryReading", "getValue", "()D", &g.battery_value},
    {"dev/edgemtp/sample/engine/BatteryReading", "getUnit", "()Ljava/lang/String;",
     &g.battery_unit},
    {"dev/edgemtp/sample/engine/MachineDescription", "getPlatform", "()Ljava/lang/String;",
     &g.machine_platform},
    {"dev/edgemtp/sample/engine/MachineDescription", "getDevice", "()Ljava/lang/String;",
     &g.machine_device},
    {"dev/edgemtp/sample/engine/MachineDescription", "getProfile", "()Ljava/lang/String;",
     &g.machine_profile},
    {"dev/edgemtp/sample/engine/MachineDescription", "getCpu", "()Ljava/lang/String;",
     &g.machine_cpu},
    {"dev/edgemtp/sample/engine/MachineDescription", "getCores", "()I", &g.machine_cores},
    {"dev/edgemtp/sample/engine/MachineDescription", "getMemoryGib", "()D", &g.machine_memory_gib},
    {"dev/edgemtp/sample/engine/MachineDescription", "getOs", "()Ljava/lang/String;",
     &g.machine_os},
    {"dev/edgemtp/sample/engine/MachineDescription", "getThreads", "()I", &g.machine_threads},
    {"dev/edgemtp/sample/engine/MachineDescription", "getLibraryNames", "()[Ljava/lang/String;",
     &g.machine_library_names},
    {"dev/edgemtp/sample/engine/MachineDescription", "getLibraryVersions", "()[Ljava/lang/String;",
     &g.machine_library_versions},
    {"java/lang/Throwable", "toString", "()Ljava/lang/String;", &g.throwable_to_string},
};

// --- errors ---------------------------------------------------------------------------------

JNIEnv* attached_env() {
  JNIEnv* env = nullptr;
  if (g_vm == nullptr || g_vm->GetEnv(reinterpret_cast<void**>(&env), JNI_VERSION_1_6) != JNI_OK) {
    return nullptr;
  }
  return env;
}

// A Kotlin exception thrown in a callback, on its way back through the core to the JNI
// boundary, where it is thrown again as itself.
class JavaException : public edgemtp::Error {
 public:
  JavaException(const std::string& message, jthrowable global)
      : edgemtp::Error(message), throwable_(global, [](_jobject* ref) {
          if (JNIEnv* env = attached_env()) env->DeleteGlobalRef(ref);
        }) {}
  jthrowable throwable() const { return static_cast<jthrowable>(throwable_.get()); }

 private:
  std::shared_ptr<_jobject> throwable_;
};

std::string to_utf8(const jchar* text, std::size_t length);

// Throws the pending Java exception, if any, as a JavaException ("where: its toString()").
void take_java_exception(JNIEnv* env, const std::string& where) {
  if (env->ExceptionCheck() == JNI_FALSE) return;
  jthrowable local = env->ExceptionOccurred();
  env->ExceptionClear();
  std::string description = "(no description)";
  auto text = static_cast<jstring>(env->CallObjectMethod(local, g.throwable_to_string));
  if (env->ExceptionCheck() == JNI_TRUE) {
    env->ExceptionClear();
  } else if (text != nullptr) {
    const jsize length = env->GetStringLength(text);
    std::vector<jchar> chars(static_cast<std::size_t>(length));
    env->GetStringRegion(text, 0, length, chars.data());
    description = to_utf8(chars.data(), chars.size());
    env->DeleteLocalRef(text);
  }
  auto global = static_cast<jthrowable>(env->NewGlobalRef(local));
  env->DeleteLocalRef(local);
  if (global == nullptr) throw std::bad_alloc();
  throw JavaException(where + ": " + description, global);
}

// --- strings --------------------------------------------------------------------------------

constexpr char32_t kReplacement = 0xFFFD;

// The engine's text is valid UTF-8 (lossy where tokens cut characters); anything else is
// replaced per ill-formed sequence, as the core's tokenizer does.
std::vector<jchar> to_utf16(std::string_view text) {
  std::vector<jchar> out;
  out.reserve(text.size());
  for (std::size_t i = 0; i < text.size();) {
    const edgemtp::Utf8Sequence sequence = edgemtp::scan_utf8(text, i);
    std::size_t length = sequence.length;
    char32_t code = kReplacement;
    if (sequence.complete) code = edgemtp::decode_utf8(text, i, length);
    if (code >= 0x10000) {
      code -= 0x10000;
      out.push_back(static_cast<jchar>(0xD800 + (code >> 10)));
      out.push_back(static_cast<jchar>(0xDC00 + (code & 0x3FF)));
    } else {
      out.push_back(static_cast<jchar>(code));
    }
    i += length;
  }
  return out;
}

std::string to_utf8(const jchar* text, std::size_t length) {
  std::string out;
  out.reserve(length);
  for (std::size_t i = 0; i < length; ++i) {
    char32_t code = text[i];
    if (code >= 0xD800 && code <= 0xDBFF && i + 1 < length && text[i + 1] >= 0xDC00 &&
        text[i + 1] <= 0xDFFF) {
      code = 0x10000 + ((code - 0xD800) << 10) + (text[i + 1] - 0xDC00u);
      ++i;
    } else if (code >= 0xD800 && code <= 0xDFFF) {
      code = kReplacement;  // a lone surrogate
    }
    edgemtp::append_utf8(out, code);
  }
  return out;
}

jstring new_string(JNIEnv* env, std::string_view utf8) {
  const std::vector<jchar> chars = to_utf16(utf8);
  jstring text = env->NewString(chars.data(), static_cast<jsize>(chars.size()));
  take_java_exception(env, "NewString");
  return text;
}

std::string read_string(JNIEnv* env, jstring text, const char* what) {
  if (text == nullptr) throw edgemtp::Error(std::string(what) + " is null");
  const jsize length = env->GetStringLength(text);
  std::vector<jchar> chars(static_cast<std::size_t>(length));
  env->GetStringRegion(text, 0, length, chars.data());
  return to_utf8(chars.data(), chars.size());
}

// A String returned by a Kotlin getter.
std::string call_string(JNIEnv* env, jobject object, jmethodID method, const char* what) {
  auto text = static_cast<jstring>(env->CallObjectMethod(object, method));
  take_java_exception(env, what);
  std::string out = read_string(env, text, what);
  env->DeleteLocalRef(text);
  return out;
}

std::vector<int> read_ints(JNIEnv* env, jintArray array, const char* what) {
  if (array == nullptr) throw edgemtp::Error(std::string(what) + " is null");
  std::vector<jint> values(static_cast<std::size_t>(env->GetArrayLength(array)));
  env->GetIntArrayRegion(array, 0, static_cast<jsize>(values.size()), values.data());
  return std::vector<int>(values.begin(), values.end());
}

jintArray new_int_array(JNIEnv* env, const std::vector<int>& values) {
  const std::vector<jint> copy(values.begin(), values.end());
  jintArray array = env->NewIntArray(static_cast<jsize>(copy.size()));
  take_java_exception(env, "NewIntArray");
  env->SetIntArrayRegion(array, 0, static_cast<jsize>(copy.size()), copy.data());
  return array;
}

std::vector<std::string> read_string_array(JNIEnv* env, jobjectArray array, const char* what) {
  std::vector<std::string> out;
  if (array == nullptr) return out;
  const jsize n = env->GetArrayLength(array);
  for (jsize i = 0; i < n; ++i) {
    auto text = static_cast<jstring>(env->GetObjectArrayElement(array, i));
    take_java_exception(env, what);
    out.push_back(read_string(env, text, what));
    env->DeleteLocalRef(text);
  }
  return out;
}

// Pops the local references a callback made, whichever way it leaves.
class LocalFrame {
 public:
  LocalFrame(JNIEnv* env, std::size_t references) : env_(env) {
    if (env_->PushLocalFrame(static_cast<jint>(references)) != 0) {
      take_java_exception(env_, "PushLocalFrame");
      throw std::bad_alloc();
    }
  }
  ~LocalFrame() { env_->PopLocalFrame(nullptr); }
  LocalFrame(const LocalFrame&) = delete;
  LocalFrame& operator=(const LocalFrame&) = delete;

 private:
  JNIEnv* env_;
};

// --- tensors --------------------------------------------------------------------------------

std::size_t element_size(DType dtype) {
  return dtype == DType::kFloat32 ? sizeof(float) : sizeof(int64_t);
}

std::size_t element_count(const std::vector<int64_t>& shape, const std::string& what) {
  std::size_t count = 1;
  for (int64_t dim : shape) {
    if (dim < 0 || (dim > 0 && count > SIZE_MAX / 16 / static_cast<std::size_t>(dim))) {
      throw edgemtp::Error(what + ": bad shape dimension " + std::to_string(dim));
    }
    count *= static_cast<std::size_t>(dim);
  }
  return count;
}

// A NativeTensor over the engine's memory; BundleRunner's contract is to read it only.
jobject new_native_tensor(JNIEnv* env, const edgemtp::TensorView& view) {
  static unsigned char empty = 0;  // NewDirectByteBuffer needs an address even for 0 bytes
  const std::size_t bytes = element_count(view.shape, view.name) * element_size(view.dtype);
  void* address = view.data != nullptr ? const_cast<void*>(view.data) : &empty;
  jobject buffer = env->NewDirectByteBuffer(address, static_cast<jlong>(bytes));
  take_java_exception(env, "NewDirectByteBuffer");
  if (buffer == nullptr) throw edgemtp::Error("this JVM has no direct ByteBuffers");

  const std::vector<jlong> dims(view.shape.begin(), view.shape.end());
  jlongArray shape = env->NewLongArray(static_cast<jsize>(dims.size()));
  take_java_exception(env, "NewLongArray");
  env->SetLongArrayRegion(shape, 0, static_cast<jsize>(dims.size()), dims.data());

  jstring name = new_string(env, view.name);
  const jint dtype = view.dtype == DType::kFloat32 ? kJavaFloat32 : kJavaInt64;
  jobject tensor = env->NewObject(g.native_tensor, g.tensor_init, name, dtype, shape, buffer);
  take_java_exception(env, "NativeTensor(" + view.name + ")");
  env->DeleteLocalRef(name);
  env->DeleteLocalRef(shape);
  env->DeleteLocalRef(buffer);
  return tensor;
}

// Copies a NativeTensor the runner returned into an engine-owned Tensor.
edgemtp::Tensor read_native_tensor(JNIEnv* env, jobject tensor, const std::string& where) {
  if (tensor == nullptr) throw edgemtp::Error(where + " is null");
  edgemtp::Tensor out;
  out.name = call_string(env, tensor, g.tensor_name, "NativeTensor.name");

  const jint dtype = env->CallIntMethod(tensor, g.tensor_dtype);
  take_java_exception(env, where);
  if (dtype != kJavaFloat32 && dtype != kJavaInt64) {
    throw edgemtp::Error(where + " has dtype code " + std::to_string(dtype) +
                         "; the engine takes float32 (0) and int64 (1)");
  }
  out.dtype = dtype == kJavaFloat32 ? DType::kFloat32 : DType::kInt64;

  auto shape = static_cast<jlongArray>(env->CallObjectMethod(tensor, g.tensor_shape));
  take_java_exception(env, where);
  if (shape == nullptr) throw edgemtp::Error(where + " has no shape");
  std::vector<jlong> dims(static_cast<std::size_t>(env->GetArrayLength(shape)));
  env->GetLongArrayRegion(shape, 0, static_cast<jsize>(dims.size()), dims.data());
  env->DeleteLocalRef(shape);
  out.shape.assign(dims.begin(), dims.end());

  jobject data = env->CallObjectMethod(tensor, g.tensor_data);
  take_java_exception(env, where);
  const void* address = data != nullptr ? env->GetDirectBufferAddress(data) : nullptr;
  const jlong capacity = data != nullptr ? env->GetDirectBufferCapacity(data) : -1;
  if (data != nullptr) env->DeleteLocalRef(data);
  const std::size_t count = element_count(out.shape, where);
  const std::size_t bytes = count * element_size(out.dtype);
  if (address == nullptr && bytes > 0)
    throw edgemtp::Error(where + ": data is not a direct ByteBuffer");
  if (capacity < static_cast<jlong>(bytes)) {
    throw edgemtp::Error(where + ": its buffer holds " + std::to_string(capacity) +
                         " bytes, its shape needs " + std::to_string(bytes));
  }
  if (out.dtype == DType::kFloat32) {
    out.f32.resize(count);
    if (bytes > 0) std::memcpy(out.f32.data(), address, bytes);
  } else {
    out.i64.resize(count);
    if (bytes > 0) std::memcpy(out.i64.data(), address, bytes);
  }
  return out;
}

// The core's MethodRunner over a Kotlin BundleRunner. The engine calls it on the thread that
// entered the native method, so that thread's JNIEnv is the one to use.
class KotlinRunner final : public edgemtp::MethodRunner {
 public:
  KotlinRunner(JNIEnv* env, jobject runner) : runner_(env->NewGlobalRef(runner)) {
    if (runner_ == nullptr) throw std::bad_alloc();
  }
  ~KotlinRunner() override {
    if (JNIEnv* env = attached_env()) env->DeleteGlobalRef(runner_);
  }
  KotlinRunner(const KotlinRunner&) = delete;
  KotlinRunner& operator=(const KotlinRunner&) = delete;

  std::vector<edgemtp::Tensor> run(const std::string& method,
                                   const std::vector<edgemtp::TensorView>& inputs) override {
    JNIEnv* env = attached_env();
    if (env == nullptr)
      throw edgemtp::Error("BundleRunner.run called on a thread the JVM does not know");
    const std::string where = "BundleRunner.run(" + method + ")";
    LocalFrame frame(env, 16 + 2 * inputs.size());

    jobjectArray tensors =
        env->NewObjectArray(static_cast<jsize>(inputs.size()), g.native_tensor, nullptr);
    take_java_exception(env, where);
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      jobject tensor = new_native_tensor(env, inputs[i]);
      env->SetObjectArrayElement(tensors, static_cast<jsize>(i), tensor);
      env->DeleteLocalRef(tensor);
    }
    jstring name = new_string(env, method);
    auto outputs =
        static_cast<jobjectArray>(env->CallObjectMethod(runner_, g.runner_run, name, tensors));
    take_java_exception(env, where);
    if (outputs == nullptr) throw edgemtp::Error(where + " returned null");

    const jsize n = env->GetArrayLength(outputs);
    std::vector<edgemtp::Tensor> out;
    out.reserve(static_cast<std::size_t>(n));
    for (jsize i = 0; i < n; ++i) {
      jobject tensor = env->GetObjectArrayElement(outputs, i);
      take_java_exception(env, where);
      out.push_back(read_native_tensor(env, tensor, where + " output " + std::to_string(i)));
      env->DeleteLocalRef(tensor);
    }
    return out;
  }

 private:
  jobject runner_;
};

// What NativeEngine's handle points at: the engine and the runner it runs methods with.
struct EngineHandle {
  EngineHandle(std::unique_ptr<edgemtp::MethodRunner> method_runner, const std::string& bundle_dir)
      : runner(std::move(method_runner)), engine(bundle_dir, *runner) {}
  std::unique_ptr<edgemtp::MethodRunner> runner;
  edgemtp::Engine engine;
};

jlong open_engine(std::unique_ptr<edgemtp::MethodRunner> runner, const std::string& bundle_dir) {
  auto handle = std::make_unique<EngineHandle>(std::move(runner), bundle_dir);
  return static_cast<jlong>(reinterpret_cast<std::intptr_t>(handle.release()));
}

EngineHandle& handle_of(jlong handle) {
  if (handle == 0) throw edgemtp::Error("the engine is closed");
  return *reinterpret_cast<EngineHandle*>(static_cast<std::intptr_t>(handle));
}

// --- the JNI boundary -----------------------------------------------------------------------

void throw_engine_exception(JNIEnv* env, const char* message) noexcept {
  try {
    jstring text = new_string(env, message);
    auto error =
        static_cast<jthrowable>(env->NewObject(g.engine_exception, g.engine_exception_init, text));
    if (error != nullptr) env->Throw(error);
  } catch (...) {
    if (env->ExceptionCheck() == JNI_FALSE) env->ThrowNew(g.engine_exception, "edgemtp: error");
  }
}

// Runs a native method's body; a C++ exception becomes the matching Kotlin exception and the
// method returns a zero value, which Kotlin never sees because the exception is pending.
template <typename Body>
auto guarded(JNIEnv* env, Body&& body) noexcept -> decltype(body()) {
  using Result = decltype(body());
  try {
    return body();
  } catch (const JavaException& error) {
    env->Throw(error.throwable());
  } catch (const edgemtp::Error& error) {
    if (env->ExceptionCheck() == JNI_FALSE) throw_engine_exception(env, error.what());
  } catch (const std::bad_alloc&) {
    if (env->ExceptionCheck() == JNI_FALSE)
      env->ThrowNew(g.out_of_memory, "edgemtp: out of native memory");
  } catch (const std::exception& error) {
    if (env->ExceptionCheck() == JNI_FALSE) {
      throw_engine_exception(env, (std::string("edgemtp internal error: ") + error.what()).c_str());
    }
  } catch (...) {
    if (env->ExceptionCheck() == JNI_FALSE) throw_engine_exception(env, "edgemtp internal error");
  }
  if constexpr (!std::is_void_v<Result>) return Result{};
}

jobject new_generation_stats(JNIEnv* env, const edgemtp::GenerateStats& stats) {
  std::vector<int> drafted, accepted;
  for (const auto& [d, a] : stats.rounds) {
    drafted.push_back(d);
    accepted.push_back(a);
  }
  jobjectArray phase_names =
      env->NewObjectArray(static_cast<jsize>(stats.seconds_by_phase.size()), g.string, nullptr);
  take_java_exception(env, "GenerationStats");
  std::vector<jdouble> phase_seconds;
  for (const auto& [phase, seconds] : stats.seconds_by_phase) {
    jstring name = new_string(env, phase);
    env->SetObjectArrayElement(phase_names, static_cast<jsize>(phase_seconds.size()), name);
    env->DeleteLocalRef(name);
    phase_seconds.push_back(seconds);
  }
  jdoubleArray seconds = env->NewDoubleArray(static_cast<jsize>(phase_seconds.size()));
  take_java_exception(env, "GenerationStats");
  env->SetDoubleArrayRegion(seconds, 0, static_cast<jsize>(phase_seconds.size()),
                            phase_seconds.data());

  jobject out = env->NewObject(
      g.generation_stats, g.stats_init, static_cast<jint>(stats.prompt_tokens),
      static_cast<jint>(stats.reused_tokens), new_int_array(env, stats.tokens),
      new_string(env, stats.text), new_string(env, stats.stop_reason), stats.ttft_s, stats.decode_s,
      stats.prefill_tok_s(), stats.decode_tok_s(), stats.acceptance(), new_int_array(env, drafted),
      new_int_array(env, accepted), phase_names, seconds);
  take_java_exception(env, "GenerationStats");
  return out;
}

edgemtp::MachineInfo read_machine(JNIEnv* env, jobject machine) {
  if (machine == nullptr) throw edgemtp::Error("no MachineDescription");
  edgemtp::MachineInfo info;
  info.platform = call_string(env, machine, g.machine_platform, "MachineDescription.platform");
  info.device = call_string(env, machine, g.machine_device, "MachineDescription.device");
  info.profile = call_string(env, machine, g.machine_profile, "MachineDescription.profile");
  info.cpu = call_string(env, machine, g.machine_cpu, "MachineDescription.cpu");
  info.os = call_string(env, machine, g.machine_os, "MachineDescription.os");
  info.cores = env->CallIntMethod(machine, g.machine_cores);
  take_java_exception(env, "MachineDescription.cores");
  info.memory_gib = env->CallDoubleMethod(machine, g.machine_memory_gib);
  take_java_exception(env, "MachineDescription.memoryGib");
  info.threads = env->CallIntMethod(machine, g.machine_threads);
  take_java_exception(env, "MachineDescription.threads");

  auto names = static_cast<jobjectArray>(env->CallObjectMethod(machine, g.machine_library_names));
  take_java_exception(env, "MachineDescription.libraryNames");
  auto versions =
      static_cast<jobjectArray>(env->CallObjectMethod(machine, g.machine_library_versions));
  take_java_exception(env, "MachineDescription.libraryVersions");
  const auto library_names = read_string_array(env, names, "MachineDescription.libraryNames");
  const auto library_versions =
      read_string_array(env, versions, "MachineDescription.libraryVersions");
  if (library_names.size() != library_versions.size()) {
    throw edgemtp::Error("MachineDescription: libraryNames and libraryVersions differ in length");
  }
  for (std::size_t i = 0; i < library_names.size(); ++i) {
    info.libraries.emplace_back(library_names[i], library_versions[i]);
  }
  return info;
}

// The reading a BenchListener gives, as both ends of a BatteryReading: the core takes the start
// from the reading before a run and the end from the one after it.
std::optional<edgemtp::BatteryReading> read_battery(JNIEnv* env, jobject listener) {
  LocalFrame frame(env, 8);
  jobject reading = env->CallObjectMethod(listener, g.bench_battery_reading);
  take_java_exception(env, "BenchListener.batteryReading");
  if (reading == nullptr) return std::nullopt;
  edgemtp::BatteryReading out;
  out.source = call_string(env, reading, g.battery_source, "BatteryReading.source");
  out.unit = call_string(env, reading, g.battery_unit, "BatteryReading.unit");
  out.start = out.end = env->CallDoubleMethod(reading, g.battery_value);
  take_java_exception(env, "BatteryReading.value");
  return out;
}

bool ask_should_stop(JNIEnv* env, jobject listener, jmethodID method, const char* where) {
  const jboolean stop = env->CallBooleanMethod(listener, method);
  take_java_exception(env, where);
  return stop == JNI_TRUE;
}

}  // namespace

extern "C" {

JNIEXPORT jint JNICALL JNI_OnLoad(JavaVM* vm, void* /*reserved*/) {
  JNIEnv* env = nullptr;
  if (vm->GetEnv(reinterpret_cast<void**>(&env), JNI_VERSION_1_6) != JNI_OK) return JNI_ERR;
  g_vm = vm;
  for (const ClassRef& ref : kClasses) {
    jclass local = env->FindClass(ref.name);
    if (local == nullptr) return JNI_ERR;  // NoClassDefFoundError is pending: loadLibrary throws it
    *ref.slot = static_cast<jclass>(env->NewGlobalRef(local));
    env->DeleteLocalRef(local);
    if (*ref.slot == nullptr) return JNI_ERR;
  }
  for (const MethodRef& ref : kMethods) {
    jclass owner = env->FindClass(ref.class_name);
    if (owner == nullptr) return JNI_ERR;
    *ref.slot = env->GetMethodID(owner, ref.name, ref.signature);
    env->DeleteLocalRef(owner);
    if (*ref.slot == nullptr) return JNI_ERR;  // NoSuchMethodError names the method
  }
  return JNI_VERSION_1_6;
}

JNIEXPORT jlong JNICALL Java_dev_edgemtp_sample_engine_NativeEngine_nativeOpen(JNIEnv* env,
                                                                               jobject /*self*/,
                                                                               jstring bundle_dir,
                                                                               jobject runner) {
  return guarded(env, [&]() -> jlong {
    if (runner == nullptr) throw edgemtp::Error("no BundleRunner");
    return open_engine(std::make_unique<KotlinRunner>(env, runner),
                       read_string(env, bundle_dir, "bundleDir"));
  });
}

JNIEXPORT jlong JNICALL Java_dev_edgemtp_sample_engine_NativeEngine_nativeOpenExecuTorch(
    JNIEnv* env, jobject /*self*/, jstring bundle_dir, jstring program, jint threads) {
  return guarded(env, [&]() -> jlong {
    edgemtp::ExecuTorchOptions options;  // shared memory arenas: the default
    options.threads = threads;
    return open_engine(
        std::make_unique<edgemtp::ExecuTorchRunner>(read_string(env, program, "program"), options),
        read_string(env, bundle_dir, "bundleDir"));
  });
}

JNIEXPORT jobject JNICALL Java_dev_edgemtp_sample_engine_NativeEngine_nativeGenerate(
    JNIEnv* env, jobject /*self*/, jlong handle, jstring prompt, jint max_new_tokens, jint depth,
    jboolean chat, jdouble temperature, jint top_k, jdouble top_p, jdouble min_p, jlong seed,
    jobject listener) {
  return guarded(env, [&]() -> jobject {
    EngineHandle& opened = handle_of(handle);
    if (listener == nullptr) throw edgemtp::Error("no GenerationListener");
    edgemtp::GenerateOptions options;
    options.max_new_tokens = max_new_tokens;
    options.depth = depth;
    options.chat = chat == JNI_TRUE;
    options.sampling.temperature = temperature;
    options.sampling.top_k = top_k;
    options.sampling.top_p = top_p;
    options.sampling.min_p = min_p;
    options.sampling.seed = static_cast<uint64_t>(seed);
    options.on_text = [env, listener](const std::string& text, const std::vector<int>& ids) {
      LocalFrame frame(env, 4);
      env->CallVoidMethod(listener, g.generation_on_text, new_string(env, text),
                          new_int_array(env, ids));
      take_java_exception(env, "GenerationListener.onText");
    };
    options.should_stop = [env, listener] {
      return ask_should_stop(env, listener, g.generation_should_stop,
                             "GenerationListener.shouldStop");
    };
    const edgemtp::GenerateStats stats =
        opened.engine.generate_text(read_string(env, prompt, "prompt"), options);
    return new_generation_stats(env, stats);
  });
}

JNIEXPORT jstring JNICALL Java_dev_edgemtp_sample_engine_NativeEngine_nativeBench(
    JNIEnv* env, jobject /*self*/, jlong handle, jstring bundle_dir, jintArray pp, jintArray tg,
    jintArray depths, jint repeat, jint tg_prompt, jlong seed, jobject machine, jstring command,
    jstring created, jobject listener) {
  return guarded(env, [&]() -> jstring {
    EngineHandle& opened = handle_of(handle);
    if (listener == nullptr) throw edgemtp::Error("no BenchListener");
    edgemtp::BenchPlan plan;
    plan.pp = read_ints(env, pp, "pp");
    plan.tg = read_ints(env, tg, "tg");
    plan.depths = read_ints(env, depths, "depths");
    plan.repeat = repeat;
    plan.tg_prompt = tg_prompt;
    plan.seed = static_cast<uint64_t>(seed);

    edgemtp::BenchHooks hooks;
    hooks.battery_before =
        hooks.battery_after = [env, listener] { return read_battery(env, listener); };
    hooks.progress = [env, listener](int done, int planned, const std::string& next) {
      LocalFrame frame(env, 4);
      env->CallVoidMethod(listener, g.bench_on_progress, static_cast<jint>(done),
                          static_cast<jint>(planned), new_string(env, next));
      take_java_exception(env, "BenchListener.onProgress");
    };
    hooks.should_stop = [env, listener] {
      return ask_should_stop(env, listener, g.bench_should_stop, "BenchListener.shouldStop");
    };
    const std::string result = edgemtp::run_bench(
        opened.engine, read_string(env, bundle_dir, "bundleDir"), plan, read_machine(env, machine),
        read_string(env, command, "command"), read_string(env, created, "created"), hooks);
    return new_string(env, result);
  });
}

JNIEXPORT void JNICALL Java_dev_edgemtp_sample_engine_NativeEngine_nativeReset(JNIEnv* env,
                                                                               jobject /*self*/,
                                                                               jlong handle) {
  guarded(env, [&] { handle_of(handle).engine.reset(); });
}

JNIEXPORT void JNICALL Java_dev_edgemtp_sample_engine_NativeEngine_nativeClose(JNIEnv* env,
                                                                               jobject /*self*/,
                                                                               jlong handle) {
  guarded(env, [&] { delete &handle_of(handle); });
}

}  // extern "C"
