# bench_test: run_bench over a fake target (no Engine needed), SHA-256/512 and PromptMaker;
# tests/test_apps_bench.py drives it and compares with runtime/bench.py and hashlib.
add_executable(bench_test ${CMAKE_CURRENT_LIST_DIR}/bench_test.cpp)
target_link_libraries(bench_test PRIVATE edgemtp_core)
edgemtp_warnings(bench_test)
