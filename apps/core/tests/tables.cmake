# tables_dump: TokenTables' gathered rows of a bundle's tables.safetensors, as float bits;
# tests/test_apps_engine.py compares them with the Python runtime's TokenTables.
add_executable(tables_dump ${CMAKE_CURRENT_LIST_DIR}/tables_dump.cpp)
target_link_libraries(tables_dump PRIVATE edgemtp_core)
edgemtp_warnings(tables_dump)
