// SHA-256 (FIPS 180-4), for the bench result's bundle identity (the hash of manifest.json) and
// its prompt hashes; and SHA-512, which Python's random.Random(str) seeds with (see bench.cpp).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace edgemtp {

class Sha256 {
 public:
  Sha256();
  void update(const void* data, std::size_t size);
  void update(std::string_view bytes) { update(bytes.data(), bytes.size()); }
  // The digest of everything updated so far; the object is spent after it.
  std::array<std::uint8_t, 32> digest();

 private:
  void compress(const std::uint8_t* block);

  std::array<std::uint32_t, 8> state_;
  std::array<std::uint8_t, 64> block_{};
  std::size_t block_used_ = 0;
  std::uint64_t total_bytes_ = 0;
};

std::array<std::uint8_t, 32> sha256(std::string_view bytes);
std::string sha256_hex(std::string_view bytes);
// The file's SHA-256 in hex; throws edgemtp::Error naming the file when it cannot be read.
std::string sha256_file_hex(const std::string& path);

std::array<std::uint8_t, 64> sha512(std::string_view bytes);

std::string to_hex(const std::uint8_t* bytes, std::size_t size);

}  // namespace edgemtp
