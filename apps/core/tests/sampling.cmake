# Sampling, speculative acceptance and adaptive depth: sampling_test checks them on its own;
# sampling_cli runs cases that tests/test_apps_sampling.py compares with the Python runtime.
add_executable(sampling_test ${CMAKE_CURRENT_SOURCE_DIR}/tests/sampling_test.cpp)
target_link_libraries(sampling_test PRIVATE edgemtp_core)
edgemtp_warnings(sampling_test)
add_test(NAME sampling_test COMMAND sampling_test)

add_executable(sampling_cli ${CMAKE_CURRENT_SOURCE_DIR}/tests/sampling_cli_test.cpp)
target_link_libraries(sampling_cli PRIVATE edgemtp_core)
edgemtp_warnings(sampling_cli)
