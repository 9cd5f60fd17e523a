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

# Kernels compiled with the flags of the library the Python runtime loads on this CPU (the tests
# pass native.py's variant as EDGEMTP_KERNEL_FLAGS): the same vector code, so this engine's
# numbers are the Python runtime's bit for bit (another vector width sums in another order, and
# an 8da4w model's near-ties then flip). Configured by hand: this machine's own.
if(NOT EDGEMTP_KERNEL_FLAGS)
  if(CMAKE_SYSTEM_PROCESSOR MATCHES "x86_64|AMD64|amd64")
    set(EDGEMTP_KERNEL_FLAGS -O3 -march=native -mprefer-vector-width=512)
  else()
    set(EDGEMTP_KERNEL_FLAGS -O3 -mcpu=native)
  endif()
endif()
include(${CMAKE_CURRENT_LIST_DIR}/../executorch/executorch.cmake)
if(TARGET executorch::runtime)  # CMake 3.28+: imported targets carry everything
  edgemtp_add_executorch(LIBRARIES ${EXECUTORCH_LIBRARIES} KERNEL_OPTIONS ${EDGEMTP_KERNEL_FLAGS})
else()  # older CMake: the package's variables, applied by hand
  edgemtp_add_executorch(LIBRARIES ${EXECUTORCH_LIBRARIES} INCLUDE_DIRS ${EXECUTORCH_INCLUDE_DIRS}
                         DEFINITIONS ${EXECUTORCH_COMPILE_DEFINITIONS}
                         KERNEL_OPTIONS ${EDGEMTP_KERNEL_FLAGS})
endif()
add_executable(engine_run ${CMAKE_CURRENT_LIST_DIR}/engine_run.cpp
                          ${CMAKE_CURRENT_LIST_DIR}/engine_cli.cpp)
target_link_libraries(engine_run PRIVATE edgemtp_executorch)
edgemtp_warnings(engine_run)
if(NOT TARGET executorch::runtime)
  target_include_directories(engine_run SYSTEM PRIVATE ${EXECUTORCH_INCLUDE_DIRS})
  set_target_properties(engine_run PROPERTIES BUILD_RPATH "${EXECUTORCH_RUNTIME_LIBRARY_DIR}")
endif()
