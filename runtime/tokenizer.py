"""The checkpoint's `tokenizer.json` (Hugging Face `tokenizers`), with Gemma's chat turn format."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from edgemtp.errors import EdgeMTPError

# Gemma 4 marks turns with <|turn> ... <turn|>; Gemma 2/3 with <start_of_turn>/<end_of_turn>.
_TURN_MARKERS = (("<|turn>", "<turn|>"), ("<start_of_turn>", "<end_of_turn>"))


class PromptTokenizer:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        known = [(s, e) for s, e in _TURN_MARKERS if tokenizer.token_to_id(s) is not None]
        self.turn = known[0] if known else None

    @property
    def extra_stop_ids(self) -> tuple[int, ...]:
        """A chat model ends its turn with the end-of-turn marker."""
        if self.turn is None:
            return ()
        return (self.tokenizer.token_to_id(self.turn[1]),)

    def encode_prompt(self, text: str, chat: bool = False) -> list[int]:
        if chat:
            if self.turn is None:
                raise EdgeMTPError("--chat: this tokenizer has no Gemma turn markers")
            start, end = self.turn
            text = f"{start}user\n{text}{end}\n{start}model\n"
        ids = self.tokenizer.encode(text).ids
        if not ids:
            raise EdgeMTPError("the prompt encodes to no tokens")
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def load_tokenizer(model_dir: Path) -> PromptTokenizer | None:
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        return PromptTokenizer(Tokenizer.from_file(str(path)))
    except Exception as err:  # tokenizers raises plain Exceptions for bad files
        raise EdgeMTPError(f"{path}: cannot load tokenizer ({err})") from None
