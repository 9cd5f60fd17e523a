# engine_run: the Engine over ExecuTorch's C++ runtime (tests/test_apps_engine.py drives it).
# Built only where ExecuTorch's CMake package is found, e.g. the executorch Python wheel's:
#   -DEDGEMTP_EXECUTORCH_DIR=.venv/lib/python3.11/site-packages/executorch
# (the package root or its lib/cmake/executorch folder); without it, the usual find_package
# search (CMAKE_PREFIX_PATH, executorch_DIR). Quietly skipped when absent.
set(EDGEMTP_EXECUTORCH_DIR "" CACHE PATH
    "ExecuTorch's package root (e.g. site-packages/executorch): builds engine_run when set")
if(EDGEMTP_EXECUTORCH_DIR)
  find_package(executorch CONFIG QUIET NO_DEFAULT_PATH
               PATHS ${EDGEMTP_EXECUTORCH_DIR} ${EDGEMTP_EXECUTORCH_DIR}/lib/cmake/executorch)
else()
  find_package(executorch CONFIG QUIET)
endif()
if(NOT executorch_FOUND OR NOT EXECUTORCH_FOUND)
  message(STATUS "engine_run: ExecuTorch's CMake package not found, not built "
                 "(set EDGEMTP_EXECUTORCH_DIR to the executorch package root)")
  return()
endif()

# edgemtp's own ExecuTorch kernels (runtime/kernels: what `--kernels edgemtp` bundles call)
# register themselves with the runtime when linked in.
file(GLOB EDGEMTP_KERNELS CONFIGURE_DEPENDS ${CMAKE_CURRENT_LIST_DIR}/../../../runtime/kernels/*.cpp)
# Compiled as the Python runtime compiles them on this host (native.py's NATIVE_FLAGS): the
# same vector code, so this engine's numbers are the Python runtime's bit for bit (another
# vector width sums in another order, and an 8da4w model's near-ties then flip).
# GCC 12's AVX-512 headers trip its own -Wmaybe-uninitialized (their _mm512_undefined_*).
if(CMAKE_SYSTEM_PROCESSOR MATCHES "x86_64|AMD64|amd64")
  set(EDGEMTP_KERNEL_FLAGS -O3 -march=native -mprefer-vector-width=512)
else()
  set(EDGEMTP_KERNEL_FLAGS -O3 -mcpu=native)
endif()
set_source_files_properties(${EDGEMTP_KERNELS} PROPERTIES COMPILE_OPTIONS
  "${EDGEMTP_KERNEL_FLAGS};$<$<CXX_COMPILER_ID:GNU>:-Wno-maybe-uninitialized>")
add_executable(engine_run ${CMAKE_CURRENT_LIST_DIR}/engine_run.cpp
                          ${CMAKE_CURRENT_LIST_DIR}/engine_cli.cpp
                          ${CMAKE_CURRENT_LIST_DIR}/executorch_runner.cpp
                          ${EDGEMTP_KERNELS})
target_link_libraries(engine_run PRIVATE edgemtp_core)
edgemtp_warnings(engine_run)
if(TARGET executorch::runtime)  # CMake 3.28+: imported targets carry everything
  target_link_libraries(engine_run PRIVATE ${EXECUTORCH_LIBRARIES})
else()  # older CMake: the package's variables, applied by hand
  target_include_directories(engine_run SYSTEM PRIVATE ${EXECUTORCH_INCLUDE_DIRS})
  target_compile_definitions(engine_run PRIVATE ${EXECUTORCH_COMPILE_DEFINITIONS})
  target_link_libraries(engine_run PRIVATE ${EXECUTORCH_LIBRARIES})
  set_target_properties(engine_run PROPERTIES BUILD_RPATH "${EXECUTORCH_RUNTIME_LIBRARY_DIR}")
endif()
