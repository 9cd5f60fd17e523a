"""The checkpoint's `tokenizer.json` (Hugging Face `tokenizers`), with Gemma's chat turn format."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from tokenizers import Tokenizer

from edgemtp.errors import EdgeMTPError

T = TypeVar("T")
# Gemma 4 marks turns with <|turn> ... <turn|>; Gemma 2/3 with <start_of_turn>/<end_of_turn>.
_TURN_MARKERS = (("<|turn>", "<turn|>"), ("<start_of_turn>", "<end_of_turn>"))


class PromptTokenizer:
    def __init__(self, tokenizer: Tokenizer, path: Path | str = "tokenizer.json"):
        self.tokenizer, self.path = tokenizer, path
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
        ids = _guarded(lambda: self.tokenizer.encode(text).ids, f"{self.path}: cannot encode")
        if not ids:
            raise EdgeMTPError("the prompt encodes to no tokens")
        return ids

    def decode(self, ids: list[int]) -> str:
        decode = lambda: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        return _guarded(decode, f"{self.path}: cannot decode")


def load_tokenizer(model_dir: Path) -> PromptTokenizer | None:
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    loaded = _guarded(lambda: Tokenizer.from_file(str(path)), f"{path}: cannot load tokenizer")
    return PromptTokenizer(loaded, path)


def token_file(path: Path, model: Path, limit: int) -> list[int]:
    """The first `limit` tokens of a file: text encoded with the model's tokenizer.json or, for a
    model without one, token ids separated by commas or spaces."""
    if not path.is_file():
        raise EdgeMTPError(f"{path}: no such file")
    text = path.read_text(errors="replace")
    tokenizer = load_tokenizer(model)
    if tokenizer is not None:
        return tokenizer.encode_prompt(text)[:limit]
    try:
        return [int(t) for t in text.replace(",", " ").split()][:limit]
    except ValueError:
        raise EdgeMTPError(
            f"{model} has no tokenizer.json, so {path} must hold token ids (commas or spaces)"
        ) from None


def _guarded(call: Callable[[], T], what: str) -> T:
    """`tokenizers` raises plain Exceptions for bad files, and on some malformed ones its Rust
    code panics: a PanicException, which derives from BaseException, not Exception."""
    try:
        return call()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # noqa: BLE001
        raise EdgeMTPError(f"{what} ({' '.join(str(err).split())[:200]})") from None
