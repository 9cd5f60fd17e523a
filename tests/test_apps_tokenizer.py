"""The apps' tokenizer (`apps/core`'s `edgemtp::Tokenizer`) against Hugging Face `tokenizers` and
runtime/tokenizer.py's `PromptTokenizer`.

`tokenizer_test` (built here with CMake) encodes, decodes and streams a file of cases with a
tokenizer.json and prints what it got; every result is compared with `tokenizers` on the same
file. The tokenizer.json kinds our bundles carry:

- byte-level BPE behind the GPT-2 pre-tokenizer: the committed `checkpoints/embedded-target` one (as
  `train.data.train_tokenizer` writes them), the same with added tokens of every flavour, and the
  one `tests/test_cli.py` builds (prefix space, no decoder, no post-processor, Gemma 2 markers);
- Gemma's SentencePiece-style BPE with byte fallback, built here with `tokenizers` as Gemma's
  checkpoints lay it out: Gemma 3/4 (Replace normalizer, Split pre-tokenizer, Replace +
  ByteFallback + Fuse decoder, <bos> template) and Gemma 1 (Prepend + Replace normalizer, no
  pre-tokenizer, a Strip decoder).

Anything else must be refused in one line naming what is unsupported.
"""

from __future__ import annotations

import json
import random
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from edgemtp.errors import EdgeMTPError
from edgemtp.runtime.tokenizer import PromptTokenizer

ROOT = Path(__file__).resolve().parents[1]
EMBEDDED = ROOT / "checkpoints" / "embedded-target" / "tokenizer.json"
SPIECE = "\u2581"

TEXTS = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "for (int i = 0; i < n; ++i) { x[i] = y[i] * 2; }",
    "    indented\n\tTabbed\r\nwindows line",
    "trailing spaces   ",
    "   leading spaces",
    "a  b   c    d",
    "line\n\n\n\nbreaks\n",
    " \n \t \n",
    "12345 67.89 1,000,000 3rd 2nd",
    "it's we're they've I'm you'll he'd don't 'tis O'Neil's",
    "IT'S WE'RE",
    "?!... ;; :: -- ** ## @@ $$ %% ^^ && || ~~ `code`",
    "caf\u00e9 na\u00efve \u00fcber r\u00e9sum\u00e9 \u00c5ngstr\u00f6m",
    "e\u0301 combining, n\u0303, \u1e9b\u0323",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3002\u4e2d\u6587\u5b57\u7b26",
    "\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8",
    "\u0627\u0644\u0639\u0631\u0628\u064a\u0629 \u0646\u0635 \u0663\u0664\u0665",
    "\u0939\u093f\u0928\u094d\u0926\u0940 \u092a\u093e\u0920",
    "emoji \U0001f600\U0001f680 \U0001f44d\U0001f3fd flags \U0001f1eb\U0001f1f7",
    "family \U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466 zwj",
    "\u00bd \u2167 \u00b2 \u2460 numbers",
    "nbsp\u00a0here ideographic\u3000space line\u2028sep",
    "control \x00\x01\x7f chars",
    "<|turn>user\nhi<turn|>",
    "<|turn>user\nWrite a poem.<turn|>\n<|turn>model\n",
    "inline <bos> and <eos> tokens<pad>",
    "<start_of_turn>user\nhello<end_of_turn>",
    "almost <|turn but not <turn|",
    "\U00010348 gothic \U0001d400 math",
    "see [note] here, say hello world  hello  world",
    "x <sep>  y<sep>z  <extra> <start_of_turn>\n\n\nend <s p>",
]

# Characters random texts are drawn from: every class the pre-tokenizers and byte fallback treat
# differently, special tokens included.
POOL = (
    list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
    + list(" " * 12 + "\t\n\r'\".,;:!?()[]{}<>/\\|-_=+*&^%$#@~`")
    + ["'s", "'re", "'ll", "\u00e9", "\u00fc", "\u0301", "\u65e5", "\u8a9e", "\u3002", "\u00a0"]
    + ["\u0663", "\u00bd", "\u0627", "\ud55c", "\U0001f600", "\u200d", "\U0001f469", "\u3000"]
    + ["<|turn>", "<turn|>", "<bos>", "<start_of_turn>", "\u2581", "\ufffd", "\x85"]
    + ["[note]", "<sep>", "hello world", "<extra>", "<s p>"]
)

CORPUS = (
    "The quick brown fox jumps over the lazy dog. It's a test of the tokenizer, isn't it?\n"
    "def main(argv):\n    for item in argv:\n        print(item, end='')\n    return 0\n"
    "Caf\u00e9 cr\u00e8me br\u00fbl\u00e9e, na\u00efve r\u00e9sum\u00e9 \u00fcber alles.\n"
    "\u65e5\u672c\u8a9e\u3068\u4e2d\u6587 \u0627\u0644\u0639\u0631\u0628\u064a\u0629 12345 67890\n"
    "Numbers 1, 22, 333; symbols !@#$%^&*() and spaces    and\ttabs.\n"
)


# --- tokenizer.json kinds ------------------------------------------------------------------------


def _byte_level_with_added(path: Path) -> Path:
    """The embedded tokenizer plus added tokens of every flavour: a normalized plain token, a
    special one, one with lstrip/rstrip, one of bytes that are not byte-level stand-ins."""
    tok = Tokenizer.from_file(str(EMBEDDED))
    tok.add_tokens(["[note]", AddedToken("<sep>", lstrip=True, rstrip=True), "\n\n"])
    tok.add_special_tokens(["<extra>", "<start_of_turn>"])
    tok.save(str(path))
    return path


def _byte_level_prefix_space(path: Path) -> Path:
    """tests/test_cli.py's tokenizer: ByteLevel with a prefix space and an unknown token, no
    decoder (decode joins tokens with spaces), no post-processor, Gemma 2 turn markers."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"],
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 20, trainer)
    tok.save(str(path))
    return path


def _gemma_style(path: Path, gemma1: bool) -> Path:
    """A SentencePiece-style BPE as Gemma's tokenizer.json lays it out: spaces as "▁", 256
    <0xNN> byte tokens after the specials, byte fallback with a fused unknown token. Gemma 3/4:
    a Replace normalizer, the Split pre-tokenizer transformers writes, a Replace + ByteFallback +
    Fuse decoder and a <bos> template; Gemma 1: a Prepend + Replace normalizer, no pre-tokenizer,
    a Strip decoder after them and no post-processor."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    specials += ["<start_of_turn>", "<end_of_turn>"] if gemma1 else ["<|turn>", "<turn|>"]
    replace = normalizers.Replace(" ", SPIECE)
    normalizer = normalizers.Sequence([normalizers.Prepend(SPIECE), replace]) if gemma1 else replace
    trained = Tokenizer(models.BPE())
    trained.normalizer = normalizer
    trainer = trainers.BpeTrainer(vocab_size=420, show_progress=False)
    trained.train_from_iterator([CORPUS] * 20, trainer)
    learned = json.loads(trained.to_str())["model"]

    pieces = specials + [f"<0x{b:02X}>" for b in range(256)]
    pieces += sorted((t for t in learned["vocab"] if t not in pieces), key=learned["vocab"].get)
    model = {
        "type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
        "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True,
        "ignore_merges": False, "vocab": {p: i for i, p in enumerate(pieces)},
        "merges": learned["merges"],
    }  # fmt: skip
    tok = Tokenizer.from_str(json.dumps({"version": "1.0", "model": model}))
    tok.normalizer = normalizer
    steps = [decoders.Replace(SPIECE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma1:
        tok.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)])
    else:
        tok.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
        tok.decoder = decoders.Sequence(steps)
        tok.post_processor = processors.TemplateProcessing(
            single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", 2)]
        )
    tok.add_special_tokens(specials)
    # Normalized: matched as "hello▁world", and decoded from that (tokenizers 0.23), so that the
    # special one is not skipped.
    tok.add_tokens(["hello world"])
    tok.add_special_tokens([AddedToken("<s p>", normalized=True)])
    tok.save(str(path))
    return path


def _ignoring_merges(path: Path) -> Path:
    """The embedded tokenizer with ignore_merges (a word in the vocabulary is its own token)."""
    doc = json.loads(EMBEDDED.read_text())
    doc["model"]["ignore_merges"] = True
    path.write_text(json.dumps(doc))
    return path


KINDS = [
    "embedded", "embedded-added", "embedded-ignore-merges", "byte-level-prefix", "gemma4-style",
    "gemma1-style",
]  # fmt: skip


@pytest.fixture(scope="module")
def tool(core_build) -> Path:
    return core_build / "tokenizer_test"


@pytest.fixture(scope="module")
def kinds(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {
        "embedded": EMBEDDED,
        "embedded-added": _byte_level_with_added(root / "added.json"),
        "embedded-ignore-merges": _ignoring_merges(root / "ignore-merges.json"),
        "byte-level-prefix": _byte_level_prefix_space(root / "prefix.json"),
        "gemma4-style": _gemma_style(root / "gemma4.json", gemma1=False),
        "gemma1-style": _gemma_style(root / "gemma1.json", gemma1=True),
    }


# --- running the C++ side ------------------------------------------------------------------------


def run_tool(tool: Path, tokenizer: Path, cases: dict[str, Any], tmp_path: Path) -> dict:
    path = tmp_path / "cases.json"
    path.write_text(json.dumps(cases))
    done = subprocess.run(
        [str(tool), str(tokenizer), str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def refusal(tool: Path, text: str, tmp_path: Path) -> str:
    path = tmp_path / "tokenizer.json"
    path.write_text(text)
    (tmp_path / "cases.json").write_text("{}")
    done = subprocess.run(
        [str(tool), str(path), str(tmp_path / "cases.json")], capture_output=True, text=True
    )
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("tokenizer.json: "), done.stderr
    return lines[0]


def random_texts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choices(POOL, k=rng.randint(1, 40))) for _ in range(count)]


def random_ids(tok: Tokenizer, count: int, seed: int) -> list[list[int]]:
    """Id sequences no encoder would write: any token, runs of byte tokens that cut characters,
    ids past the vocabulary (which decoding skips)."""
    rng = random.Random(seed)
    size = tok.get_vocab_size()
    byte_ids = [i for i in (tok.token_to_id(f"<0x{b:02X}>") for b in range(256)) if i is not None]
    if not byte_ids:  # byte-level: the stand-ins of bytes 0x80.. are single-byte tokens
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        byte_ids = [i for i in map(tok.token_to_id, alphabet) if i is not None]

    def pick() -> int:
        return rng.choice(byte_ids) if rng.random() < 0.6 else rng.randrange(size)

    return [[pick() for _ in range(12)] for _ in range(count)] + [[size + 3, 2, size + 100]]


def utf8_pieces(pieces: list[str]) -> list[str]:
    """The stream's pieces (hex of bytes), each of which must be whole UTF-8 characters."""
    return [bytes.fromhex(p).decode("utf-8") for p in pieces]


# --- comparisons ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_matches_tokenizers(kind, kinds, tool, tmp_path):
    tok = Tokenizer.from_file(str(kinds[kind]))
    prompt_tok = PromptTokenizer(tok)
    texts = TEXTS + random_texts(150, seed=KINDS.index(kind))
    encoded = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    id_lists = encoded + random_ids(tok, 60, seed=7) + [[]]
    tokens = ["<bos>", "<|turn>", "<turn|>", "<start_of_turn>", "<end_of_turn>", "[note]", "the"]
    cases = {
        "encode": texts,
        "decode": id_lists,
        "stream": id_lists,
        "prompts": TEXTS,
        "tokens": tokens,
    }
    got = run_tool(tool, kinds[kind], cases, tmp_path)

    for text, ids, result in zip(texts, encoded, got["encode"], strict=True):
        assert result["without"] == ids, repr(text)
        assert result["with"] == tok.encode(text).ids, repr(text)
    for ids, decoded, streamed in zip(id_lists, got["decode"], got["stream"], strict=True):
        for skip, key in ((True, "skip"), (False, "keep")):
            want = tok.decode(ids, skip_special_tokens=skip)
            assert decoded[key] == want, ids
            assert "".join(utf8_pieces(streamed[key])) == want, ids
    for text, result in zip(TEXTS, got["prompts"], strict=True):
        for chat in (False, True):
            try:
                want = prompt_tok.encode_prompt(text, chat=chat)
            except EdgeMTPError:
                want = None
            key = "chat" if chat else "plain"
            if want is None:
                assert "error" in result[key], (text, chat)
            else:
                assert result[key] == want, (text, chat)
    assert got["token_to_id"] == {t: tok.token_to_id(t) for t in tokens}
    assert got["vocab_size"] == tok.get_vocab_size()
    stops = prompt_tok.extra_stop_ids
    assert got["end_of_turn_id"] == (stops[0] if stops else None)


@pytest.mark.parametrize("kind", ["embedded", "gemma4-style"])
def test_round_trip_and_held_back_characters(kind, kinds, tool, tmp_path):
    """Text without special tokens decodes back to itself, and a stream releases a character
    only once its last byte is in: with characters split across tokens some pushes give ""."""
    tok = Tokenizer.from_file(str(kinds[kind]))
    texts = [t for t in TEXTS if "<" not in t] + ["\u8a9e\U0001f680\u00e9" * 5]
    id_lists = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    got = run_tool(tool, kinds[kind], {"decode": id_lists, "stream": id_lists}, tmp_path)
    for text, decoded in zip(texts, got["decode"], strict=True):
        assert decoded["keep"] == text
    split = got["stream"][-1]["skip"]
    pieces = utf8_pieces(split)
    assert "".join(pieces) == texts[-1]
    assert len(split) == len(id_lists[-1]) + 1 and "" in pieces[:-1]


@pytest.mark.parametrize("kind", ["embedded", "gemma4-style", "gemma1-style"])
def test_long_prompt_is_fast(kind, kinds, tool, tmp_path):
    """A 20,000-character prompt: the same ids, in well under a second (the Gemma kinds merge
    it as one word: no pre-tokenizer splits it)."""
    tok = Tokenizer.from_file(str(kinds[kind]))
    rng = random.Random(3)
    words = CORPUS.split(" ") + ["\U0001f600", "\u00e9t\u00e9", "x" * 30]
    text = " ".join(rng.choice(words) for _ in range(6000))[:20000]
    started = time.perf_counter()
    got = run_tool(tool, kinds[kind], {"encode": [text]}, tmp_path)
    elapsed = time.perf_counter() - started
    assert got["encode"][0]["with"] == tok.encode(text).ids
    assert got["encode_seconds"] / 2 < 0.5, got["encode_seconds"]
    assert elapsed < 5


@pytest.mark.parametrize("invert", [False, True])
@pytest.mark.parametrize(
    "behavior", ["removed", "isolated", "merged_with_previous", "merged_with_next", "contiguous"]
)
def test_split_behaviors(behavior, invert, kinds, tool, tmp_path):
    """The Split pre-tokenizer's every behavior, on "▁" after the Gemma normalizer."""
    tok = Tokenizer.from_file(str(kinds["gemma4-style"]))
    tok.pre_tokenizer = pre_tokenizers.Split(SPIECE, behavior, invert=invert)
    path = tmp_path / "split.json"
    tok.save(str(path))
    texts = TEXTS + random_texts(60, seed=11)
    got = run_tool(tool, path, {"encode": texts}, tmp_path)
    for text, result in zip(texts, got["encode"], strict=True):
        assert result["with"] == tok.encode(text).ids, repr(text)


def test_self_check(tool):
    done = subprocess.run([str(tool), "--self-check"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


# --- refusals ------------------------------------------------------------------------------------


BERT_PROCESSING = {"type": "BertProcessing", "sep": ["<eos>", 1], "cls": ["<bos>", 2]}


def _embedded_with(**changes: Any) -> str:
    doc = json.loads(EMBEDDED.read_text())
    doc.update(changes)
    return json.dumps(doc)


def test_refuses_other_models(tool, tmp_path):
    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    assert "WordPiece" in refusal(tool, wordpiece.to_str(), tmp_path)
    unigram = Tokenizer(models.Unigram([("<unk>", 0.0), ("a", -1.0)], unk_id=0))
    assert "Unigram" in refusal(tool, unigram.to_str(), tmp_path)


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"normalizer": {"type": "NFKC"}}, "normalizer NFKC"),
        ({"pre_tokenizer": {"type": "Whitespace"}}, "pre_tokenizer Whitespace"),
        ({"decoder": {"type": "WordPiece", "prefix": "##", "cleanup": True}}, "decoder WordPiece"),
        ({"post_processor": BERT_PROCESSING}, "post_processor BertProcessing"),
        (
            {"normalizer": {"type": "Replace", "pattern": {"Regex": "\\s"}, "content": " "}},
            "Regex",
        ),
        ({"truncation": {"max_length": 8, "strategy": "LongestFirst", "stride": 0}}, "truncation"),
    ],
)
def test_refuses_unsupported_steps(changes, named, tool, tmp_path):
    text = _embedded_with(**changes)
    Tokenizer.from_str(text)  # tokenizers itself loads it: the limit is the apps'
    assert named in refusal(tool, text, tmp_path)


def test_refuses_malformed_json(tool, tmp_path):
    text = EMBEDDED.read_text()
    assert "line " in refusal(tool, text[: len(text) // 2], tmp_path)
    assert "model" in refusal(tool, json.dumps({"model": {"type": "BPE"}}), tmp_path)
