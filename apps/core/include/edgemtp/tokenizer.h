// A bundle's tokenizer.json (Hugging Face `tokenizers` format) in C++17: encode a prompt and
// decode a stream of ids into UTF-8 text, as `tokenizers` does for the tokenizers our bundles
// carry (byte-level BPE and SentencePiece-style BPE with byte fallback). The Python runtime's
// runtime/tokenizer.py (`PromptTokenizer`) is the behaviour this matches, Gemma's chat turn
// markers included.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace edgemtp {

class Tokenizer {
 public:
  // The text of a tokenizer.json. Throws edgemtp::Error (decode.h), one line starting
  // "tokenizer.json: ", for malformed JSON and for any model, normalizer, pre-tokenizer,
  // post-processor or decoder this implementation does not support (naming it).
  static Tokenizer from_json_text(std::string_view text);
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // tokenizers' `encode(text, add_special_tokens=add_special).ids`: added/special tokens in the
  // text are matched first, the rest normalized, pre-tokenized and BPE-merged; the
  // post-processor's template (e.g. a leading <bos>) applies when add_special.
  std::vector<int> encode(std::string_view text, bool add_special = true) const;
  // tokenizers' `decode(ids, skip_special_tokens=skip_special)`.
  std::string decode(const std::vector<int>& ids, bool skip_special = true) const;

  // PromptTokenizer.encode_prompt(text, chat): with `chat`, wraps the text in the turn markers
  // (<|turn>user\n{text}<turn|>\n<|turn>model\n, or Gemma 2/3's <start_of_turn>/<end_of_turn>).
  // Throws Error when `chat` and the tokenizer has no turn markers, or when the prompt encodes
  // to no tokens.
  std::vector<int> encode_prompt(std::string_view text, bool chat) const;
  // The end-of-turn marker's id when the tokenizer has turn markers (a chat model's stop id).
  std::optional<int> end_of_turn_id() const;

  std::optional<int> token_to_id(std::string_view token) const;
  int vocab_size() const;  // including added tokens

  // Streaming detokenization: push ids as they are committed, get the text they complete.
  // Text is released only as whole UTF-8 characters, and equals, concatenated with finish(),
  // decode(all ids pushed, skip_special).
  class Stream {
   public:
    explicit Stream(const Tokenizer& tokenizer, bool skip_special = true);
    std::string push(int id);
    std::string finish();

   private:
    const Tokenizer* tokenizer_;
    bool skip_special_;
    std::vector<int> ids_;  // pushed ids whose text is not released yet
    bool started_ = false;  // some token's text was released: the decoder is mid-text
  };

  struct Impl;

 private:
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace edgemtp
