"""Import Hugging Face Gemma 4 checkpoints: targets (text-only or multimodal) and assistants.

Linear and norm weights are converted to the compute dtype; the token and per-layer embedding
tables stay memory-mapped in their stored dtype (see TokenTables).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from edgemtp.errors import EdgeMTPError
from edgemtp.model.config import (
    ASSISTANT_MODEL_TYPE,
    AssistantConfig,
    TextConfig,
    check_drafter_matches,
    parse_assistant_config,
    parse_text_config,
    read_config_json,
)
from edgemtp.model.gemma4 import Gemma4Drafter, Gemma4Target, TokenTables, register_rope
from edgemtp.model.safetensors_file import SafetensorsFile

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


class WeightStore:
    """All tensors of a checkpoint folder (single file or sharded), by name, memory-mapped."""

    def __init__(self, model_dir: Path):
        model_dir = Path(model_dir)
        index = model_dir / "model.safetensors.index.json"
        single = model_dir / "model.safetensors"
        self.files: dict[str, SafetensorsFile] = {}
        self.where: dict[str, str] = {}
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                assert isinstance(weight_map, dict)
            except Exception:
                raise EdgeMTPError(f"{index}: corrupt shard index (no weight_map)") from None
            for name, shard in weight_map.items():
                shard_path = (model_dir / str(shard)).resolve()
                if shard_path.parent != model_dir.resolve():
                    raise EdgeMTPError(f"{index}: shard '{shard}' is outside the model folder")
                if shard not in self.files:
                    if not shard_path.is_file():
                        raise EdgeMTPError(f"{index}: shard '{shard}' is missing from {model_dir}")
                    self.files[shard] = SafetensorsFile(shard_path)
                if name not in self.files[shard].keys():
                    raise EdgeMTPError(f"{index}: tensor '{name}' is not in shard '{shard}'")
                self.where[name] = shard
        elif single.is_file():
            self.files["model.safetensors"] = SafetensorsFile(single)
            self.where = {
                name: "model.safetensors" for name in self.files["model.safetensors"].keys()
            }
        else:
            raise EdgeMTPError(
                f"{model_dir}: no model.safetensors or model.safetensors.index.json "
                "(edgemtp reads safetensors checkpoints; convert .bin/.pt files first)"
            )

    def names(self) -> list[str]:
        return list(self.where)

    def get(self, name: str) -> torch.Tensor:
        return self.files[self.where[name]].tensor(name)


def _text_prefix(names: list[str]) -> str:
    if any(n.startswith(_MULTIMODAL_TEXT_PREFIX) for n in names):
        return _MULTIMODAL_TEXT_PREFIX
    return "model."


def _load_module(
    module: nn.Module, store: WeightStore, rename: dict[str, str], dtype: torch.dtype, where: str
) -> None:
    """Copy every parameter/buffer of `module` from the store (checkpoint name via `rename`)."""
    state = module.state_dict()
    for key, dest in state.items():
        source = rename[key]
        if source not in store.where:
            raise EdgeMTPError(f"{where}: tensor '{source}' is missing from the checkpoint")
        tensor = store.get(source)
        if tuple(tensor.shape) != tuple(dest.shape):
            raise EdgeMTPError(
                f"{where}: tensor '{source}' has shape {list(tensor.shape)}, "
                f"the config implies {list(dest.shape)}"
            )
        dest.copy_(tensor.to(dest.dtype if not dest.is_floating_point() else dtype))
    module.to(dtype)


def _check_no_unknown(
    store: WeightStore, used: set[str], ignorable: tuple[str, ...], where: str
) -> None:
    for name in store.names():
        if name in used or name.startswith(_MULTIMODAL_IGNORED):
            continue
        if any(part in name for part in ignorable):
            continue
        raise EdgeMTPError(
            f"{where}: unexpected tensor '{name}': the checkpoint has parts edgemtp does not model "
            "(is the config.json from another model?)"
        )


@dataclass
class Target:
    cfg: TextConfig
    model: Gemma4Target
    tables: TokenTables
    path: Path


@dataclass
class Drafter:
    cfg: AssistantConfig
    model: Gemma4Drafter
    path: Path


def load_target_config(model_dir: Path) -> TextConfig:
    raw = read_config_json(model_dir)
    where = str(Path(model_dir) / "config.json")
    model_type = raw.get("model_type")
    if model_type == "gemma4":
        return parse_text_config(
            dict(raw.get("text_config") or {}, model_type="gemma4_text"), where
        )
    if model_type == "gemma4_text":
        return parse_text_config(raw, where)
    if model_type == ASSISTANT_MODEL_TYPE:
        raise EdgeMTPError(f"{model_dir} is a Gemma 4 assistant (drafter); pass it as --drafter")
    raise EdgeMTPError(
        f"{where}: unsupported model_type '{model_type}' (edgemtp supports Gemma 4: "
        "gemma4, gemma4_text and gemma4_assistant)"
    )


def load_target(model_dir: Path, dtype: torch.dtype = torch.float32) -> Target:
    cfg = load_target_config(model_dir)
    where = str(model_dir)
    store = WeightStore(model_dir)
    prefix = _text_prefix(store.names())
    with torch.device("meta"):
        model = Gemma4Target(cfg)
    model = model.to_empty(device="cpu")
    register_rope(model, cfg)
    head_name = "lm_head.weight"
    tied = head_name not in store.where or cfg.raw.get("tie_word_embeddings", True)
    rename = {k: prefix + k for k in model.state_dict() if k != "lm_head.weight"}
    rename["lm_head.weight"] = prefix + "embed_tokens.weight" if tied else head_name
    _load_module(model, store, rename, dtype, where)
    tokens = store.get(prefix + "embed_tokens.weight")
    per_layer = None
    if cfg.hidden_size_per_layer_input:
        name = prefix + "embed_tokens_per_layer.weight"
        if name not in store.where:
            raise EdgeMTPError(f"{where}: tensor '{name}' is missing from the checkpoint")
        per_layer = store.get(name)
        expected = (
            cfg.vocab_size_per_layer_input,
            cfg.num_layers * cfg.hidden_size_per_layer_input,
        )
        if tuple(per_layer.shape) != expected:
            raise EdgeMTPError(
                f"{where}: tensor '{name}' has shape {list(per_layer.shape)}, "
                f"the config implies {list(expected)}"
            )
    used = set(rename.values()) | {
        prefix + "embed_tokens.weight",
        prefix + "embed_tokens_per_layer.weight",
    }
    _check_no_unknown(store, used, _SHARED_LAYER_EXTRAS, where)
    model.eval().requires_grad_(False)
    tables = TokenTables(tokens, per_layer, cfg.num_layers, cfg.hidden_size_per_layer_input)
    return Target(cfg, model, tables, Path(model_dir))


def load_drafter_config(model_dir: Path) -> AssistantConfig:
    raw = read_config_json(model_dir)
    where = str(Path(model_dir) / "config.json")
    if raw.get("model_type") != ASSISTANT_MODEL_TYPE:
        raise EdgeMTPError(
            f"{where}: model_type '{raw.get('model_type')}' is not a Gemma 4 assistant "
            "(expected gemma4_assistant)"
        )
    return parse_assistant_config(raw, where)


def load_drafter(
    model_dir: Path, target: TextConfig, dtype: torch.dtype = torch.float32
) -> Drafter:
    cfg = load_drafter_config(model_dir)
    check_drafter_matches(target, cfg)
    where = str(model_dir)
    store = WeightStore(model_dir)
    with torch.device("meta"):
        model = Gemma4Drafter(cfg, target)
    model = model.to_empty(device="cpu")
    register_rope(model, cfg.text)
    tied = "lm_head.weight" not in store.where or cfg.raw.get("tie_word_embeddings", True)
    rename = {}
    for key in model.state_dict():
        if key.startswith("layers.") or key.startswith("norm."):
            rename[key] = "model." + key
        else:
            rename[key] = key
    rename["lm_head.weight"] = "model.embed_tokens.weight" if tied else "lm_head.weight"
    _load_module(model, store, rename, dtype, where)
    _check_no_unknown(store, set(rename.values()), (), where)
    model.eval().requires_grad_(False)
    return Drafter(cfg, model, Path(model_dir))
