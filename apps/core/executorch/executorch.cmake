# edgemtp_executorch: the ExecuTorch MethodRunner (executorch_runner.cpp) and edgemtp's own
# ExecuTorch kernels (runtime/kernels: what `--kernels edgemtp` bundles call), for a program that
# runs bundles with ExecuTorch's C++ runtime: the Android app's JNI library and the host's
# engine_run. The caller says which ExecuTorch to link (the wheel's CMake package on a host, the
# in-tree targets of a source build in the app) and how to compile the kernels.
#
#   edgemtp_add_executorch(LIBRARIES <targets> [INCLUDE_DIRS <dirs>] [DEFINITIONS <defs>]
#                          [KERNEL_OPTIONS <flags>])
set(EDGEMTP_EXECUTORCH_LIST_DIR ${CMAKE_CURRENT_LIST_DIR})

function(edgemtp_add_executorch)
  cmake_parse_arguments(ARG "" "" "LIBRARIES;INCLUDE_DIRS;DEFINITIONS;KERNEL_OPTIONS" ${ARGN})
  file(GLOB kernels CONFIGURE_DEPENDS
       ${EDGEMTP_EXECUTORCH_LIST_DIR}/../../../runtime/kernels/*.cpp)
  # An object library: each kernel registers itself with the runtime from a static initializer,
  # which a static archive would let the linker drop.
  add_library(edgemtp_executorch OBJECT
              ${EDGEMTP_EXECUTORCH_LIST_DIR}/executorch_runner.cpp ${kernels})
  target_include_directories(edgemtp_executorch PUBLIC ${EDGEMTP_EXECUTORCH_LIST_DIR})
  target_include_directories(edgemtp_executorch SYSTEM PRIVATE ${ARG_INCLUDE_DIRS})
  target_compile_definitions(edgemtp_executorch PRIVATE ${ARG_DEFINITIONS})
  target_link_libraries(edgemtp_executorch PUBLIC edgemtp_core ${ARG_LIBRARIES})
  # GCC 12's AVX-512 headers trip its own -Wmaybe-uninitialized (their _mm512_undefined_*).
  set_source_files_properties(${kernels} PROPERTIES COMPILE_OPTIONS
    "${ARG_KERNEL_OPTIONS};$<$<CXX_COMPILER_ID:GNU>:-Wno-maybe-uninitialized>")
  set_source_files_properties(${EDGEMTP_EXECUTORCH_LIST_DIR}/executorch_runner.cpp PROPERTIES
    COMPILE_OPTIONS "$<$<NOT:$<CXX_COMPILER_ID:MSVC>>:-Wall;-Wextra;-Werror>")
endfunction()
