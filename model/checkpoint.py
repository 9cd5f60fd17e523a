"""Import Hugging Face Gemma 4 checkpoints: targets (text-only or multimodal) and assistants.

Linear and norm weights are converted to the compute dtype; the token and per-layer embedding
tables stay memory-mapped in their stored dtype (see TokenTables).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch._guards import detect_fake_mode

from edgemtp.errors import EdgeMTPError
from edgemtp.model.config import (
    ASSISTANT_MODEL_TYPE,
    AssistantConfig,
    TextConfig,
    check_drafter_matches,
    parse_assistant_config,
    parse_text_config,
)
from edgemtp.model.gemma4 import Gemma4Drafter, Gemma4Target, register_rope
from edgemtp.model.primitives import REFERENCE_FORM, Form, apply_form
from edgemtp.model.safetensors_file import SafetensorsFile
from edgemtp.model.tables import Rows, TokenTables

# Multimodal checkpoints keep the language model here and these towers beside it.
_MULTIMODAL_TEXT_PREFIX = "model.language_model."
_MULTIMODAL_IGNORED = (
    "model.vision_tower.",
    "model.audio_tower.",
    "model.embed_vision.",
    "model.embed_audio.",
    "model.multi_modal_projector.",
)
_SHARED_LAYER_EXTRAS = ("k_proj", "v_proj", "k_norm", "v_norm")


class TensorSource:
    """The tensors of one checkpoint, by Hugging Face name.

    This class reads plain safetensors folders (single file or sharded, memory-mapped); GGUF files
    and quantized layouts subclass it in `edgemtp.quantize` (`quantize/load.py` opens any).
    """

    def __init__(self, path: Path, config: dict[str, Any]):
        self.path = Path(path)
        self.config = config

    @cached_property
    def where(self) -> dict[str, SafetensorsFile]:
        """Tensor name -> the file holding it (files are opened on first use, after the config
        has been checked)."""
        index = self.path / "model.safetensors.index.json"
        single = self.path / "model.safetensors"
        if single.is_file() and not index.is_file():
            file = SafetensorsFile(single)
            return dict.fromkeys(file.keys(), file)
        if not index.is_file():
            raise EdgeMTPError(
                f"{self.path}: no model.safetensors or model.safetensors.index.json "
                "(edgemtp reads safetensors checkpoints; convert .bin/.pt files first)"
            )
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            assert isinstance(weight_map, dict)
        except Exception:
            raise EdgeMTPError(f"{index}: corrupt shard index (no weight_map)") from None
        files: dict[str, SafetensorsFile] = {}
        where: dict[str, SafetensorsFile] = {}
        for name, shard in weight_map.items():
            if not isinstance(shard, str):
                raise EdgeMTPError(f"{index}: tensor '{name}' maps to {shard!r}, not a file name")
            try:
                shard_path = (self.path / shard).resolve()
                found = shard_path.is_file()
            except (OSError, ValueError):  # a name too long, or with a NUL byte
                raise EdgeMTPError(f"{index}: shard {shard[:80]!r} is not a file name") from None
            if shard_path.parent != self.path.resolve():
                raise EdgeMTPError(f"{index}: shard '{shard}' is outside the model folder")
            if shard not in files:
                if not found:
                    raise EdgeMTPError(f"{index}: shard '{shard}' is missing from {self.path}")
                files[shard] = SafetensorsFile(shard_path)
            if name not in files[shard].keys():
                raise EdgeMTPError(f"{index}: tensor '{name}' is not in shard '{shard}'")
            where[name] = files[shard]
        return where

    def raw(self, name: str) -> torch.Tensor:
        """A stored tensor as it is in the file (memory-mapped)."""
        return self.where[name].tensor(name)

    def raw_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows of a stored tensor read into fresh memory, for streaming through big tables."""
        return self.where[name].read_rows(name, start, stop)

    def names(self) -> list[str]:
        """Names of the weights this checkpoint provides (quantized ones under their float name)."""
        return list(self.where)

    def tensor(self, name: str) -> torch.Tensor:
        """A weight for the compute graph, dequantized if it is stored quantized."""
        return self.raw(name)

    def table(self, name: str) -> Rows:
        """A host-side lookup table: rows are gathered (and dequantized) only when looked up."""
        return self.raw(name)

    def release_pages(self) -> None:
        """Drop the checkpoint's read pages from resident memory (`SafetensorsFile`)."""
        if "where" in self.__dict__:  # files opened
            for file in {id(f): f for f in self.where.values()}.values():
                file.release_pages()

    def shape_4bit(self, name: str) -> tuple[int, int] | None:
        """The float shape of a weight stored in 4 bits, None for any other (a plain safetensors
        folder stores none). Read from the stored layout: nothing is unpacked."""
        return None

    def scheme_4bit(self, name: str) -> str | None:
        """ "q4_0" or "w4a16" for a weight stored in 4 bits, None for any other; nothing is
        unpacked."""
        return None


class StoredLinear(nn.Linear):
    """A linear whose weight is stored 4-bit in the checkpoint and is not held as floats: each
    use of `weight` reads it from the (memory-mapped) checkpoint and dequantizes it. Exports
    whose form replaces such linears by their 4-bit codes then never hold the float model."""

    def __init__(self, linear: nn.Linear, source: TensorSource, name: str, dtype: torch.dtype):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = None
        self.source, self.name, self.dtype = source, name, dtype
        # What `weight` is while set: a tracer that knows weights by identity and writes the
        # 4-bit form in their place (ONNX's) runs the model on a stand-in of its shape.
        self.stand_in: torch.Tensor | None = None

    @property  # type: ignore[override]
    def weight(self) -> torch.Tensor:
        if self.stand_in is not None:
            return self.stand_in
        if detect_fake_mode() is not None:  # tracing shapes: nothing to read
            return torch.empty(self.out_features, self.in_features, dtype=self.dtype)
        return self.source.tensor(self.name).to(self.dtype)


def _text_prefix(names: list[str]) -> str:
    if any(n.startswith(_MULTIMODAL_TEXT_PREFIX) for n in names):
        return _MULTIMODAL_TEXT_PREFIX
    return "model."


def _load_module(
    module: nn.Module, source: TensorSource, rename: dict[str, str], dtype: torch.dtype
) -> None:
    """Copy every parameter/buffer of `module` from the source (checkpoint name via `rename`)."""
    names = set(source.names())
    for key, dest in module.state_dict().items():
        name = rename[key]
        if name not in names:
            raise EdgeMTPError(f"{source.path}: tensor '{name}' is missing from the checkpoint")
        tensor = source.tensor(name)
        if tuple(tensor.shape) != tuple(dest.shape):
            raise EdgeMTPError(
                f"{source.path}: tensor '{name}' has shape {list(tensor.shape)}, "
                f"the config implies {list(dest.shape)}"
            )
        dest.copy_(tensor.to(dtype if dest.is_floating_point() else dest.dtype))
    module.to(dtype)


def _materialize(model: nn.Module, source: TensorSource) -> nn.Module:
    """Allocate a model built on the meta device, once its size is possible: every weight takes
    at least half a byte in a checkpoint (4 bits), so a config declaring more parameters than
    twice the checkpoint's bytes is from another model, and is refused before a byte of it is
    allocated (a vocab_size of 10^9 would ask for gigabytes)."""
    params = sum(t.numel() for t in model.state_dict().values())
    files = [source.path] if source.path.is_file() else source.path.glob("*.safetensors")
    stored = sum(f.stat().st_size for f in files)
    if params > 2 * stored + 2**20:
        raise EdgeMTPError(
            f"{source.path}: config.json declares {params:,} parameters, more than the "
            f"checkpoint's {stored:,} bytes can hold; the config is from another model"
        )
    return model.to_empty(device="cpu")


def _check_no_unknown(source: TensorSource, used: set[str], ignorable: tuple[str, ...]) -> None:
    for name in source.names():
        if name in used or name.startswith(_MULTIMODAL_IGNORED):
            continue
        if any(part in name for part in ignorable):
            continue
        raise EdgeMTPError(
            f"{source.path}: unexpected tensor '{name}': the checkpoint has parts edgemtp does "
            "not model (is the config.json from another model?)"
        )


def _table(source: TensorSource, name: str, shape: tuple[int, int]) -> Rows:
    if name not in source.names():
        raise EdgeMTPError(f"{source.path}: tensor '{name}' is missing from the checkpoint")
    table = source.table(name)
    if tuple(table.shape) != shape:
        raise EdgeMTPError(
            f"{source.path}: tensor '{name}' has shape {list(table.shape)}, "
            f"the config implies {list(shape)}"
        )
    return table


@dataclass
class Target:
    cfg: TextConfig
    model: Gemma4Target
    tables: TokenTables
    source: TensorSource
    names: dict[str, str]  # state-dict key of `model` -> the checkpoint tensor it was loaded from
    form: Form = REFERENCE_FORM  # what the model's weights compute as (`use_form`)

    @property
    def path(self) -> Path:
        return self.source.path

    def use_form(self, form: Form) -> dict[str, Any]:
        """Convert the model's weights to `form` (in place): the reference engine then computes
        what that backend form's programs compute."""
        self.form = form
        return apply_form([self.model], form)


@dataclass
class Drafter:
    cfg: AssistantConfig
    model: Gemma4Drafter
    source: TensorSource
    names: dict[str, str]  # state-dict key of `model` -> the checkpoint tensor it was loaded from
    form: Form = REFERENCE_FORM

    def use_form(self, form: Form) -> dict[str, Any]:
        self.form = form
        return apply_form([self.model], form)


def target_config(raw: dict[str, Any], where: str) -> TextConfig:
    """The text decoder config of a target checkpoint's config.json."""
    model_type = raw.get("model_type")
    if model_type == "gemma4":
        text = dict(raw.get("text_config") or {}, model_type="gemma4_text")
        return parse_text_config(text, where)
    if model_type == "gemma4_text":
        return parse_text_config(raw, where)
    if model_type == ASSISTANT_MODEL_TYPE:
        raise EdgeMTPError(f"{where} is a Gemma 4 assistant (drafter); pass it as --drafter")
    raise EdgeMTPError(
        f"{where}: unsupported model_type '{model_type}' (edgemtp supports Gemma 4: "
        "gemma4, gemma4_text and gemma4_assistant)"
    )


def _store_4bit_linears(
    model: nn.Module, source: TensorSource, rename: dict[str, str], dtype: torch.dtype
) -> None:
    """Replace (in place, on the meta device) every linear whose weight the checkpoint stores in
    4 bits by a `StoredLinear`."""
    for path, module in list(model.named_modules()):
        name = rename.get(f"{path}.weight")
        shape = source.shape_4bit(name) if type(module) is nn.Linear and name else None
        if shape is None:
            continue
        if shape != (module.out_features, module.in_features):
            raise EdgeMTPError(
                f"{source.path}: tensor '{name}' has shape {list(shape)}, the config implies "
                f"{[module.out_features, module.in_features]}"
            )
        parent, _, leaf = path.rpartition(".")
        setattr(model.get_submodule(parent), leaf, StoredLinear(module, source, name, dtype))


def target_from_source(
    source: TensorSource, dtype: torch.dtype = torch.float32, float_4bit: bool = True
) -> Target:
    """The target of an opened checkpoint (`quantize.load.load_target` opens any kind).
    `float_4bit=False`: linears stored in 4 bits keep no float weight (`StoredLinear`)."""
    cfg = target_config(source.config, str(source.path))
    prefix = _text_prefix(source.names())
    with torch.device("meta"):
        model = Gemma4Target(cfg)
    tied = "lm_head.weight" not in source.names() or cfg.raw.get("tie_word_embeddings", True)
    rename = {k: prefix + k for k in model.state_dict()}
    rename["lm_head.weight"] = prefix + "embed_tokens.weight" if tied else "lm_head.weight"
    if not float_4bit:
        _store_4bit_linears(model, source, rename, dtype)
    model = _materialize(model, source)
    register_rope(model, cfg)
    _load_module(model, source, rename, dtype)
    tokens_name = prefix + "embed_tokens.weight"
    tokens = _table(source, tokens_name, (cfg.vocab_size, cfg.hidden_size))
    per_layer, ple_name = None, prefix + "embed_tokens_per_layer.weight"
    if cfg.hidden_size_per_layer_input:
        shape = (cfg.vocab_size_per_layer_input, cfg.num_layers * cfg.hidden_size_per_layer_input)
        per_layer = _table(source, ple_name, shape)
    _check_no_unknown(source, {*rename.values(), tokens_name, ple_name}, _SHARED_LAYER_EXTRAS)
    model.eval().requires_grad_(False)
    tables = TokenTables(tokens, per_layer, cfg.num_layers, cfg.hidden_size_per_layer_input)
    return Target(cfg, model, tables, source, rename)


def drafter_config(raw: dict[str, Any], where: str) -> AssistantConfig:
    if raw.get("model_type") != ASSISTANT_MODEL_TYPE:
        raise EdgeMTPError(
            f"{where}: model_type '{raw.get('model_type')}' is not a Gemma 4 assistant "
            "(expected gemma4_assistant)"
        )
    return parse_assistant_config(raw, where)


def drafter_from_source(
    source: TensorSource, target: TextConfig, dtype: torch.dtype = torch.float32
) -> Drafter:
    """The assistant of an opened checkpoint, checked against its target's config."""
    cfg = drafter_config(source.config, str(source.path))
    check_drafter_matches(target, cfg)
    with torch.device("meta"):
        model = Gemma4Drafter(cfg, target)
    model = _materialize(model, source)
    register_rope(model, cfg.text)
    tied = "lm_head.weight" not in source.names() or cfg.raw.get("tie_word_embeddings", True)
    rename = {
        k: "model." + k if k.startswith(("layers.", "norm.")) else k for k in model.state_dict()
    }
    rename["lm_head.weight"] = "model.embed_tokens.weight" if tied else "lm_head.weight"
    _load_module(model, source, rename, dtype)
    _check_no_unknown(source, set(rename.values()), ())
    model.eval().requires_grad_(False)
    return Drafter(cfg, model, source, rename)
