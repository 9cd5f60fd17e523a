# engine_pipe: the Engine over a MethodRunner that asks whoever answers on stdin, so that
# tests/test_apps_engine.py runs ONNX and Core ML bundles' methods in Python while the engine's
# own host side (cache arrays, slot positions, tables, decoding) is tested in C++.
add_executable(engine_pipe ${CMAKE_CURRENT_LIST_DIR}/engine_pipe.cpp
                           ${CMAKE_CURRENT_LIST_DIR}/engine_cli.cpp)
target_link_libraries(engine_pipe PRIVATE edgemtp_core)
edgemtp_warnings(engine_pipe)
