// The checks the core's ctest programs count: a failed check prints where and what, and the
// program's exit status (summary) says whether any failed.
#pragma once

#include <cmath>
#include <iostream>
#include <string>

namespace edgemtp_test {

inline int failures = 0;

inline void check(bool ok, const std::string& what, const char* file, int line) {
  if (!ok) {
    ++failures;
    std::cerr << file << ":" << line << ": FAILED: " << what << "\n";
  }
}

// main's return value: 0 when every check passed.
inline int summary(const char* program) {
  if (failures != 0) {
    std::cerr << failures << " check(s) failed\n";
    return 1;
  }
  std::cout << program << ": all checks passed\n";
  return 0;
}

}  // namespace edgemtp_test

#define CHECK(cond) edgemtp_test::check((cond), #cond, __FILE__, __LINE__)
#define CHECK_MSG(cond, what) edgemtp_test::check((cond), (what), __FILE__, __LINE__)
#define CHECK_EQ(a, b) edgemtp_test::check((a) == (b), #a " == " #b, __FILE__, __LINE__)
#define CHECK_NEAR(a, b, tol) \
  edgemtp_test::check(std::fabs((a) - (b)) <= (tol), #a " ~ " #b, __FILE__, __LINE__)
