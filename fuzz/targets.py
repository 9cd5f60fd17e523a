"""Fuzz targets: each parses fuzzer bytes as one kind of outside input, the way edgemtp reads it.

The contract every target checks: the parser returns, or raises `EdgeMTPError` (the one clear
line the CLI prints). Any other exception, a crash, a hang or an allocation past the fuzzer's
memory limit is a finding. Files are written to a private folder under /dev/shm (or the temp
dir) because the readers take paths and memory-map them, as they do with real checkpoints.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from edgemtp.errors import EdgeMTPError
from edgemtp.model.checkpoint import TensorSource
from edgemtp.model.config import parse_assistant_config, parse_text_config, read_config_json
from edgemtp.model.safetensors_file import SafetensorsFile
from edgemtp.quantize.gguf_import import GGUFSource
from edgemtp.quantize.w4a16 import parse_quantization_config
from edgemtp.runtime.bundle import read_manifest, verify_files
from edgemtp.runtime.tokenizer import load_tokenizer

_SHM = "/dev/shm" if os.path.isdir("/dev/shm") else None
_ROOT = Path(tempfile.mkdtemp(prefix="edgemtp-fuzz-", dir=_SHM))


def _file(name: str, data: bytes, folder: str = "") -> Path:
    """Write `data` as `name` (in a sub-folder `folder`, made once) of the fuzzing folder."""
    (_ROOT / folder).mkdir(exist_ok=True)
    path = _ROOT / folder / name
    path.write_bytes(data)
    return path


def _config_json(data: bytes) -> dict:
    """`data` as a model folder's config.json, read the way every loader reads it."""
    return read_config_json(_file("config.json", data, "config").parent)


def safetensors(data: bytes) -> None:
    """A safetensors file: header, every entry, and one element of every tensor touched."""
    f = SafetensorsFile(_file("model.safetensors", data))
    for name in f.keys():
        t = f.tensor(name)
        if t.numel():
            t.reshape(-1)[-1].item()


def gguf(data: bytes) -> None:
    """A GGUF file as `--model x.gguf` opens it: header, key-values, tensor infos, the config
    built from them, the shape checks, then every tensor read."""
    source = GGUFSource(_file("model.gguf", data))
    for name in source.names():
        source.tensor(name)


def config(data: bytes) -> None:
    """A config.json, read as a target's and as an assistant's."""
    raw = _config_json(data)
    for parse in (parse_text_config, parse_assistant_config):
        try:
            parse(raw)
        except EdgeMTPError:
            pass


def quantization_config(data: bytes) -> None:
    """A W4A16 checkpoint's config.json with its compressed-tensors `quantization_config`."""
    parse_quantization_config(_config_json(data))


def shard_index(data: bytes) -> None:
    """A `model.safetensors.index.json` beside one small shard: names, shard paths (which must
    stay inside the folder), the shard files they open."""
    folder = _ROOT / "sharded"
    if not folder.is_dir():
        from safetensors.torch import save_file

        folder.mkdir()
        save_file({"a": torch.ones(2), "b": torch.zeros(3, dtype=torch.int8)}, folder / SHARD)
    (folder / "model.safetensors.index.json").write_bytes(data)
    source = TensorSource(folder, {})
    for name in source.names():
        source.raw(name)


def tokenizer(data: bytes) -> None:
    """A `tokenizer.json`: loaded, then a prompt encoded (plain and as a chat turn) and decoded."""
    loaded = load_tokenizer(_file("tokenizer.json", data, "tokenizer").parent)
    if loaded is not None:
        for chat in (False, True):
            loaded.decode(loaded.encode_prompt("Hello, wörld 12 ", chat=chat))


def manifest(data: bytes) -> None:
    """A bundle's `manifest.json`: schema version, schema, the files it names (which must stay
    inside the bundle), then every listed file checked against its size and SHA-256."""
    folder = _file("manifest.json", data, "bundle").parent
    verify_files(folder, read_manifest(folder))


SHARD = "model-00001-of-00001.safetensors"
TARGETS: dict[str, Callable[[bytes], None]] = {
    "safetensors": safetensors,
    "gguf": gguf,
    "config": config,
    "quantization_config": quantization_config,
    "shard_index": shard_index,
    "tokenizer": tokenizer,
    "manifest": manifest,
}


def check(target: str, data: bytes) -> None:
    """Run one input through a target; only `EdgeMTPError` may escape as an expected failure."""
    try:
        TARGETS[target](data)
    except EdgeMTPError:
        pass
