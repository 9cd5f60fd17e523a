"""The embedded default model's data: CPython's standard library sources, and its tokenizer.

Everything is deterministic: files are taken in sorted relative-path order, the held-out split is
chosen by a hash of the relative path, and a manifest records the interpreter version, the counts
and the sha256 of each split so the model card can state exactly what was trained on.

Layout of a prepared data folder:
    train.txt, held_out.txt   the split's files, each after a header line `FILE_HEADER + path`
    manifest.json             what was used (see `write_splits`)
    tokenizer.json            byte-level BPE, vocabulary VOCAB_SIZE (+ tokenizer_config.json)
    train_ids.npy, held_out_ids.npy   uint16 token streams: files joined by <eos>
"""

from __future__ import annotations

import hashlib
import json
import platform
import re
import sysconfig
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from edgemtp.errors import EdgeMTPError

CORPUS_NAME = "CPython standard library (.py sources)"
LICENSE = (
    "Python Software Foundation License Version 2 (PSF-2.0); https://docs.python.org/3/license.html"
)
# encodings/ is mostly generated codec tables: 14 % of the bytes, nothing a model should learn.
EXCLUDED_DIRS = frozenset(
    {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__", "encodings"}
)
MAX_FILE_BYTES = 200_000
HELD_OUT_PER_MILLE = 50  # ~5 % of the files
FILE_HEADER = "# <<<edgemtp:file "  # + relative path + ">>>": one line before each file
_HEADER_RE = re.compile(r"^# <<<edgemtp:file (.*)>>>\n", re.MULTILINE)

VOCAB_SIZE = 8192  # a multiple of the drafter's 64 centroids
# Ids as the Gemma config (`model/synth.py: _text_dict`) expects them: pad 0, eos 1, bos 2.
SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", "<turn|>")
PAD_ID, EOS_ID, BOS_ID = 0, 1, 2

SPLITS = ("train", "held_out")


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path | None = None) -> list[str]:
    """Relative paths (posix, sorted) of the stdlib's .py files we train on."""
    root = Path(root or stdlib_dir())
    if not root.is_dir():
        raise EdgeMTPError(f"{root}: standard library folder not found; pass an existing root")
    paths = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if EXCLUDED_DIRS.intersection(rel.parts[:-1]) or not path.is_file():
            continue
        if path.stat().st_size > MAX_FILE_BYTES:
            continue
        paths.append(rel.as_posix())
    return sorted(paths)


def is_held_out(rel_path: str) -> bool:
    digest = hashlib.sha256(rel_path.encode()).digest()
    return int.from_bytes(digest[:8], "little") % 1000 < HELD_OUT_PER_MILLE


def split_files(paths: Iterable[str]) -> dict[str, list[str]]:
    paths = sorted(paths)
    return {
        "train": [p for p in paths if not is_held_out(p)],
        "held_out": [p for p in paths if is_held_out(p)],
    }


def read_source(root: Path, rel: str) -> str | None:
    """The file's text exactly (newlines kept), or None if it is not UTF-8."""
    try:
        with open(root / rel, encoding="utf-8", newline="") as f:
            return f.read()
    except UnicodeDecodeError:
        return None


def join_files(docs: list[tuple[str, str]]) -> str:
    out = []
    for rel, text in docs:
        if _HEADER_RE.search(text):
            raise EdgeMTPError(f"{rel}: contains the file separator line; cannot join it")
        out.append(f"{FILE_HEADER}{rel}>>>\n{text}")
        if text and not text.endswith("\n"):
            out.append("\n")
    return "".join(out)


def split_documents(joined: str) -> list[str]:
    """Inverse of `join_files` (up to the newline added to files that lacked one)."""
    parts = _HEADER_RE.split(joined)
    return parts[2::2]  # [before first header, path, text, path, text, ...]


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def write_splits(out_dir: Path, root: Path | None = None) -> dict[str, Any]:
    """Write train.txt, held_out.txt and manifest.json into out_dir; return the manifest."""
    root = Path(root or stdlib_dir())
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest: dict[str, Any] = {
        "corpus": CORPUS_NAME,
        "license": LICENSE,
        "python_version": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "source_root": str(root),
        "rules": {
            "files": "*.py under the stdlib folder, sorted by relative path",
            "excluded_dirs": sorted(EXCLUDED_DIRS),
            "max_file_bytes": MAX_FILE_BYTES,
            "held_out": f"sha256(relative path)[:8] as little-endian int % 1000 < "
            f"{HELD_OUT_PER_MILLE}",
            "separator": f"a line '{FILE_HEADER}<relative path>>>' before each file",
        },
        "skipped_not_utf8": [],
        "splits": {},
    }
    for name, paths in split_files(source_files(root)).items():
        docs = []
        for rel in paths:
            text = read_source(root, rel)
            if text is None:
                manifest["skipped_not_utf8"].append(rel)
            else:
                docs.append((rel, text))
        joined = join_files(docs)
        (out_dir / f"{name}.txt").write_text(joined, encoding="utf-8", newline="")
        manifest["splits"][name] = {
            "file": f"{name}.txt",
            "files": len(docs),
            "bytes": len(joined.encode()),
            "sha256": _sha256(joined),
            "paths": [rel for rel, _ in docs],
        }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def read_split(data_dir: Path, name: str) -> list[str]:
    path = Path(data_dir) / f"{name}.txt"
    if not path.is_file():
        raise EdgeMTPError(f"{path}: missing; run the data preparation step (prepare) first")
    with open(path, encoding="utf-8", newline="") as f:
        return split_documents(f.read())


_DEF_LINE_RE = re.compile(r"^[ \t]*(async[ \t]+)?def [^\n]*:[ \t]*$", re.MULTILINE)


def held_out_prompts(data_dir: Path, count: int, context_lines: int = 12) -> list[str]:
    """Code-completion prompts no training step saw: in each held-out file (sorted by path), the
    first one-line `def` signature and the lines just before it; the model writes the body."""
    prompts = []
    for doc in read_split(data_dir, "held_out"):
        match = _DEF_LINE_RE.search(doc)
        if match is None:
            continue
        lines = doc[: match.end()].split("\n")
        prompts.append("\n".join(lines[-context_lines:]) + "\n")
        if len(prompts) == count:
            break
    return prompts


# --- tokenizer ---------------------------------------------------------------------------------


def train_tokenizer(docs: Iterable[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Byte-level BPE (GPT-2 style pre-tokenization, every byte in the alphabet, so any text
    round-trips exactly); encoding prepends <bos> like Gemma's tokenizer."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", BOS_ID)]
    )
    check_tokenizer(tok, vocab_size)
    return tok


def check_tokenizer(tok: Tokenizer, vocab_size: int = VOCAB_SIZE) -> None:
    if tok.get_vocab_size() != vocab_size:
        raise EdgeMTPError(
            f"tokenizer has {tok.get_vocab_size()} tokens, expected {vocab_size}; "
            "the training text is too small for this vocabulary"
        )
    for i, name in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(name) != i:
            raise EdgeMTPError(f"tokenizer: {name} has id {tok.token_to_id(name)}, expected {i}")


def save_tokenizer(tok: Tokenizer, out_dir: Path) -> None:
    out_dir = Path(out_dir)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def encode_documents(tok: Tokenizer, docs: list[str]) -> np.ndarray:
    """One uint16 stream: each document's tokens followed by <eos> (no <bos>: training samples
    get theirs at position 0)."""
    parts = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        parts.append(np.asarray(enc.ids, dtype=np.uint16))
        parts.append(np.asarray([EOS_ID], dtype=np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


def prepare(data_dir: Path, root: Path | None = None, log: Callable[[str], None] = print) -> Path:
    """Build whatever the data folder lacks: splits + manifest, tokenizer, token streams."""
    data_dir = Path(data_dir)
    if not (data_dir / "manifest.json").is_file():
        log(f"writing splits of {root or stdlib_dir()} to {data_dir}")
        manifest = write_splits(data_dir, root)
        for name, s in manifest["splits"].items():
            log(f"  {name}: {s['files']} files, {s['bytes']} bytes")
    if not (data_dir / "tokenizer.json").is_file():
        log(f"training a {VOCAB_SIZE}-token byte-level BPE on the train split")
        save_tokenizer(train_tokenizer(read_split(data_dir, "train")), data_dir)
    tok = load_data_tokenizer(data_dir)
    for name in SPLITS:
        path = data_dir / f"{name}_ids.npy"
        if not path.is_file():
            ids = encode_documents(tok, read_split(data_dir, name))
            np.save(path, ids)
            log(f"  {name}: {len(ids)} tokens")
    return data_dir


def load_data_tokenizer(data_dir: Path) -> Tokenizer:
    path = Path(data_dir) / "tokenizer.json"
    if not path.is_file():
        raise EdgeMTPError(f"{path}: missing; prepare the data folder first")
    tok = Tokenizer.from_file(str(path))
    check_tokenizer(tok)
    return tok


def load_ids(data_dir: Path, name: str) -> np.ndarray:
    path = Path(data_dir) / f"{name}_ids.npy"
    if not path.is_file():
        raise EdgeMTPError(f"{path}: missing; prepare the data folder first")
    return np.load(path)
