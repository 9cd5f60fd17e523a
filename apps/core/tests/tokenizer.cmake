# The tokenizer (src/tokenizer.cpp): tokenizer_test compares it with Hugging Face `tokenizers`
# under tests/test_apps_tokenizer.py; its self-check needs no oracle.
add_executable(tokenizer_test ${CMAKE_CURRENT_LIST_DIR}/tokenizer_test.cpp)
target_link_libraries(tokenizer_test PRIVATE edgemtp_core)
edgemtp_warnings(tokenizer_test)
add_test(NAME tokenizer_self_check COMMAND tokenizer_test --self-check)
