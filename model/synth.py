"""Synthetic random-weight Gemma 4 checkpoints in the real Hugging Face layout.

Presets give the true E2B / E4B target and assistant shapes (plus a tiny matched pair for tests), so
speed and memory can be measured without downloading weights. Files are streamed: the safetensors
header is written first, then every tensor is generated in bounded row chunks and appended, so a
full E2B (~9 GB in bf16) never sits in memory. Output is deterministic: each chunk's random stream
is seeded from (seed, tensor name, chunk index), never from the order of generation.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from edgemtp.errors import EdgeMTPError
from edgemtp.model.config import (
    AssistantConfig,
    TextConfig,
    parse_assistant_config,
    parse_text_config,
)
from edgemtp.model.safetensors_file import TensorEntry, write_tensors

PRESETS: tuple[str, ...] = (
    "e2b",
    "e4b",
    "e2b-assistant",
    "e4b-assistant",
    "tiny",
    "tiny-assistant",
    "peer-90m",
)

DTYPES: dict[str, str] = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
DEFAULT_SHARD_SIZE = 2 * 1024**3  # ~2 GiB per file, as Hugging Face shards
TRANSFORMERS_LAYOUT_VERSION = "5.24.0"  # the transformers release whose layout we write

# Elements generated per chunk. Part of the output definition (it fixes each chunk's seed), so it
# must not change; 4 Mi float32 elements = 16 MiB before conversion.
_CHUNK_ELEMS = 1 << 22

InitKind = Literal["normal", "ones", "permutation"]


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a checkpoint: name, shape and how it is initialised."""

    name: str
    shape: tuple[int, ...]
    init: InitKind = "normal"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def nbytes(self, dtype: str) -> int:
        return self.numel * (8 if self.init == "permutation" else _itemsize(dtype))

    def st_dtype(self, dtype: str) -> str:
        return "I64" if self.init == "permutation" else DTYPES[dtype]


@dataclass(frozen=True)
class _TargetShape:
    hidden: int
    intermediate: int
    period: int  # layers per pattern block: (period - 1) sliding then 1 full
    own_blocks: int  # blocks that own their KV
    shared_blocks: int  # blocks of KV-shared layers at the end
    heads: int
    kv_heads: int
    head_dim: int
    global_head_dim: int
    ple: int
    vocab: int
    window: int
    tail: int = 0  # KV-shared layers after the shared blocks, the pattern going on, the last full
    double_wide: bool = True  # KV-shared layers' MLP twice as wide (E2B's public config only)


@dataclass(frozen=True)
class _AssistantShape:
    target: str
    hidden: int
    intermediate: int
    layers: int  # (layers - 1) sliding then 1 full
    heads: int
    centroids: int
    top_k: int


_TARGETS: dict[str, _TargetShape] = {
    # 35 layers = 3 own + 4 shared blocks of 5; store layers 13 (sliding) and 14 (full).
    "e2b": _TargetShape(1536, 6144, 5, 3, 4, 8, 1, 256, 512, 256, 262_144, 512),
    # 42 layers = 4 own + 3 shared blocks of 6; store layers 22 (sliding) and 23 (full).
    "e4b": _TargetShape(2560, 10240, 6, 4, 3, 8, 2, 256, 512, 256, 262_144, 512, double_wide=False),
    # 10 layers = 1 own + 1 shared block of 5; store layers 3 and 4; window 16.
    "tiny": _TargetShape(64, 128, 5, 1, 1, 4, 1, 16, 32, 16, 512, 16),
    # "PEER-90M", the shape edgemtp is compared with llama.cpp and ExecuTorch's example on
    # (benchmarks/peers): 12 layers = 1 own + 1 shared block of 5 + 2 shared (sliding, full);
    # 7 KV-shared layers; store layers 3 and 4 (where llama.cpp wants them).
    "peer-90m": _TargetShape(
        512, 2048, 5, 1, 1, 4, 1, 128, 256, 64, 32_768, 512, tail=2, double_wide=False
    ),
}

_ASSISTANTS: dict[str, _AssistantShape] = {
    "e2b-assistant": _AssistantShape("e2b", 256, 2048, 4, 4, 2048, 32),
    "e4b-assistant": _AssistantShape("e4b", 256, 2048, 4, 4, 2048, 32),
    "tiny-assistant": _AssistantShape("tiny", 32, 64, 2, 2, 16, 4),
}

_ROPE_PARAMETERS: dict[str, dict[str, Any]] = {
    "full_attention": {
        "partial_rotary_factor": 0.25,
        "rope_theta": 1_000_000.0,
        "rope_type": "proportional",
    },
    "sliding_attention": {"rope_theta": 10_000.0, "rope_type": "default"},
}


def _itemsize(dtype: str) -> int:
    return {"bfloat16": 2, "float16": 2, "float32": 4}[dtype]


def _check_scale(scale: float) -> None:
    if not (isinstance(scale, int | float) and 0 < scale <= 1):
        raise EdgeMTPError(f"scale must be in (0, 1], got {scale!r}")


def _scaled(value: int, scale: float, multiple: int) -> int:
    """Scale a width, rounded to `multiple` (at least `multiple`, never above the original)."""
    if scale == 1:
        return value
    rounded = int(value * scale / multiple + 0.5) * multiple
    return min(value, max(multiple, rounded))


def _scaled_blocks(blocks: int, scale: float) -> int:
    return max(1, int(blocks * scale + 0.5))


def _per_layer_config(layer_types: list[str], global_head_dim: int) -> dict[str, dict[str, int]]:
    """Full-layer head_dim overrides, keyed as transformers 5.24 serialises them (zero-padded)."""
    full = [i for i, t in enumerate(layer_types) if t == "full_attention"]
    digits = len(str(max(full)))
    return {str(i).zfill(digits): {"head_dim": global_head_dim} for i in full}


def _text_dict(
    *,
    hidden: int,
    intermediate: int,
    layer_types: list[str],
    num_kv_shared: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    global_head_dim: int,
    ple: int,
    vocab: int,
    window: int,
    double_wide: bool,
    init_std: float,
) -> dict[str, Any]:
    return {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attention_k_eq_v": False,
        "bos_token_id": 2,
        "enable_moe_block": False,
        "eos_token_id": 1,
        "final_logit_softcapping": 30.0,
        "head_dim": head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": hidden,
        "hidden_size_per_layer_input": ple,
        "initializer_range": init_std,
        "intermediate_size": intermediate,
        "layer_types": layer_types,
        "max_position_embeddings": 131_072,
        "model_type": "gemma4_text",
        "moe_intermediate_size": None,
        "num_attention_heads": heads,
        "num_experts": None,
        "num_hidden_layers": len(layer_types),
        "num_key_value_heads": kv_heads,
        "num_kv_shared_layers": num_kv_shared,
        "pad_token_id": 0,
        "per_layer_config": _per_layer_config(layer_types, global_head_dim),
        "rms_norm_eps": 1e-06,
        "rope_parameters": json.loads(json.dumps(_ROPE_PARAMETERS)),
        "sliding_window": window,
        "tie_word_embeddings": True,
        "top_k_experts": None,
        "use_bidirectional_attention": None,
        "use_cache": True,
        "use_double_wide_mlp": double_wide,
        "vocab_size": vocab,
        "vocab_size_per_layer_input": vocab if ple else 0,
    }


def _target_dict(shape: _TargetShape, scale: float, init_std: float) -> dict[str, Any]:
    blocks_own = _scaled_blocks(shape.own_blocks, scale)
    blocks_shared = _scaled_blocks(shape.shared_blocks, scale)
    p = shape.period
    n = p * (blocks_own + blocks_shared) + shape.tail
    layer_types = [
        "full_attention" if i % p == p - 1 or i == n - 1 else "sliding_attention" for i in range(n)
    ]
    return _text_dict(
        hidden=_scaled(shape.hidden, scale, 64),
        intermediate=_scaled(shape.intermediate, scale, 64),
        layer_types=layer_types,
        num_kv_shared=p * blocks_shared + shape.tail,
        heads=shape.heads,
        kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        global_head_dim=shape.global_head_dim,
        ple=_scaled(shape.ple, scale, 8),
        vocab=shape.vocab,
        window=shape.window,
        double_wide=shape.double_wide,
        init_std=init_std,
    )


def _assistant_dict(shape: _AssistantShape, scale: float, init_std: float) -> dict[str, Any]:
    target = _TARGETS[shape.target]
    layer_types = ["sliding_attention"] * (shape.layers - 1) + ["full_attention"]
    text = _text_dict(
        hidden=_scaled(shape.hidden, scale, 64),
        intermediate=_scaled(shape.intermediate, scale, 64),
        layer_types=layer_types,
        num_kv_shared=shape.layers,
        heads=shape.heads,
        kv_heads=target.kv_heads,
        head_dim=target.head_dim,
        global_head_dim=target.global_head_dim,
        ple=0,
        vocab=target.vocab,
        window=target.window,
        double_wide=False,
        init_std=init_std,
    )
    return {
        "architectures": ["Gemma4AssistantForCausalLM"],
        "backbone_hidden_size": _scaled(target.hidden, scale, 64),
        "centroid_intermediate_top_k": shape.top_k,
        "model_type": "gemma4_assistant",
        "num_centroids": shape.centroids,
        "text_config": text,
        "tie_word_embeddings": True,
        "use_ordered_embeddings": True,
    }


def preset_config(
    preset: str, scale: float = 1.0, *, dtype: str = "bfloat16", init_std: float = 0.02
) -> dict[str, Any]:
    """The Hugging Face `config.json` dict of a preset (no weights)."""
    _check_scale(scale)
    if dtype not in DTYPES:
        raise EdgeMTPError(f"dtype '{dtype}' is not supported (choose from {', '.join(DTYPES)})")
    if preset in _TARGETS:
        cfg = _target_dict(_TARGETS[preset], scale, init_std)
        cfg["architectures"] = ["Gemma4ForCausalLM"]
    elif preset in _ASSISTANTS:
        cfg = _assistant_dict(_ASSISTANTS[preset], scale, init_std)
    else:
        raise EdgeMTPError(f"unknown preset '{preset}' (choose from {', '.join(PRESETS)})")
    cfg["dtype"] = dtype
    cfg["transformers_version"] = TRANSFORMERS_LAYOUT_VERSION
    return dict(sorted(cfg.items()))


def _decoder_specs(text: TextConfig) -> list[TensorSpec]:
    h, ple = text.hidden_size, text.hidden_size_per_layer_input
    specs = [TensorSpec("model.embed_tokens.weight", (text.vocab_size, h))]
    for layer in text.layers:
        pre = f"model.layers.{layer.index}."
        d = layer.head_dim
        q, kv = text.num_heads * d, layer.num_kv_heads * d
        specs += [
            TensorSpec(pre + "input_layernorm.weight", (h,), "ones"),
            TensorSpec(pre + "self_attn.q_proj.weight", (q, h)),
            TensorSpec(pre + "self_attn.q_norm.weight", (d,), "ones"),
        ]
        if layer.owns_kv:
            specs.append(TensorSpec(pre + "self_attn.k_proj.weight", (kv, h)))
            if not layer.k_eq_v:
                specs.append(TensorSpec(pre + "self_attn.v_proj.weight", (kv, h)))
            specs.append(TensorSpec(pre + "self_attn.k_norm.weight", (d,), "ones"))
        i = layer.intermediate_size
        specs += [
            TensorSpec(pre + "self_attn.o_proj.weight", (h, q)),
            TensorSpec(pre + "post_attention_layernorm.weight", (h,), "ones"),
            TensorSpec(pre + "pre_feedforward_layernorm.weight", (h,), "ones"),
            TensorSpec(pre + "mlp.gate_proj.weight", (i, h)),
            TensorSpec(pre + "mlp.up_proj.weight", (i, h)),
            TensorSpec(pre + "mlp.down_proj.weight", (h, i)),
            TensorSpec(pre + "post_feedforward_layernorm.weight", (h,), "ones"),
        ]
        if ple:
            specs += [
                TensorSpec(pre + "per_layer_input_gate.weight", (ple, h)),
                TensorSpec(pre + "per_layer_projection.weight", (h, ple)),
                TensorSpec(pre + "post_per_layer_input_norm.weight", (h,), "ones"),
            ]
        specs.append(TensorSpec(pre + "layer_scalar", (1,), "ones"))
    specs.append(TensorSpec("model.norm.weight", (h,), "ones"))
    if ple:
        n = text.num_layers * ple
        specs += [
            TensorSpec("model.embed_tokens_per_layer.weight", (text.vocab_size_per_layer_input, n)),
            TensorSpec("model.per_layer_model_projection.weight", (n, h)),
            TensorSpec("model.per_layer_projection_norm.weight", (ple,), "ones"),
        ]
    return specs


def tensor_specs(config: dict[str, Any]) -> list[TensorSpec]:
    """Every tensor a Gemma 4 target or assistant checkpoint stores, in file order.

    Tied LM heads are not stored (as transformers saves them); KV-shared layers have no k/v
    projections or norms; `v_norm` has no weight.
    """
    if config.get("model_type") == "gemma4_assistant":
        assistant: AssistantConfig = parse_assistant_config(config)
        text, b = assistant.text, assistant.backbone_hidden_size
        specs = _decoder_specs(text)
        specs += [
            TensorSpec("pre_projection.weight", (text.hidden_size, 2 * b)),
            TensorSpec("post_projection.weight", (b, text.hidden_size)),
        ]
        if assistant.use_ordered_embeddings:
            specs += [
                TensorSpec(
                    "masked_embedding.centroids.weight",
                    (assistant.num_centroids, text.hidden_size),
                ),
                TensorSpec("masked_embedding.token_ordering", (text.vocab_size,), "permutation"),
            ]
        return specs
    return _decoder_specs(parse_text_config(config))


def _stream_seed(seed: int, name: str, chunk: int) -> np.random.Generator:
    digest = hashlib.sha256(f"edgemtp-synth\0{seed}\0{name}\0{chunk}".encode()).digest()
    return np.random.Generator(np.random.SFC64(int.from_bytes(digest[:16], "little")))


def _to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (round to nearest even), as uint16."""
    try:
        import ml_dtypes  # shipped with onnx / executorch; fast native cast

        return x.astype(ml_dtypes.bfloat16).view(np.uint16)
    except ImportError:  # pragma: no cover - bit-exact fallback
        u = x.view(np.uint32)
        u += ((u >> 16) & 1) + np.uint32(0x7FFF)
        return (u >> 16).astype(np.uint16)


def _encode(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return _to_bf16_bits(x)
    if dtype == "float16":
        return x.astype(np.float16)
    return x


def _chunks(spec: TensorSpec) -> list[tuple[int, int]]:
    """Element ranges [start, stop) of a tensor's chunks: whole rows, at most _CHUNK_ELEMS each."""
    if spec.init != "normal":
        return [(0, spec.numel)]
    row = spec.shape[-1] if len(spec.shape) > 1 else spec.numel
    rows = spec.numel // row
    per = max(1, _CHUNK_ELEMS // row)
    return [(r * row, min(rows, r + per) * row) for r in range(0, rows, per)]


def _make_chunk(
    spec: TensorSpec, index: int, span: tuple[int, int], seed: int, dtype: str, std: float
) -> np.ndarray:
    n = span[1] - span[0]
    if spec.init == "permutation":
        return _stream_seed(seed, spec.name, 0).permutation(spec.numel).astype("<i8")
    if spec.init == "ones":
        return _encode(np.ones(n, dtype=np.float32), dtype)
    x = _stream_seed(seed, spec.name, index).standard_normal(n, dtype=np.float32)
    x *= np.float32(std)
    return _encode(x, dtype)


def _producer(
    specs: list[TensorSpec],
    seed: int,
    dtype: str,
    init_std: float,
    pool: ThreadPoolExecutor,
    lookahead: int,
) -> Callable[[TensorEntry], Iterator[np.ndarray]]:
    """Chunks of each tensor, generated `lookahead` at a time on the pool, yielded in order."""
    by_name = {spec.name: spec for spec in specs}

    def produce(entry: TensorEntry) -> Iterator[np.ndarray]:
        spec = by_name[entry.name]
        jobs = iter(enumerate(_chunks(spec)))
        pending: deque[Future[np.ndarray]] = deque()
        for i, span in jobs:
            pending.append(pool.submit(_make_chunk, spec, i, span, seed, dtype, init_std))
            if len(pending) >= lookahead:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()

    return produce


def write_preset(
    preset: str,
    out_dir: Path,
    *,
    scale: float = 1.0,
    seed: int = 0,
    dtype: str = "bfloat16",
    init_std: float = 0.02,
    progress: Callable[[str], None] | None = None,
    shard_size: int = DEFAULT_SHARD_SIZE,
    workers: int | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a random-weight checkpoint of `preset` to `out_dir`; return `out_dir`.

    An existing non-empty `out_dir` is an error unless `overwrite` and it holds a checkpoint.

    Weights are normal(0, init_std), norms and `layer_scalar` 1.0, the assistant's token ordering a
    seeded permutation. Same preset/scale/seed/dtype give byte-identical files. The folder appears
    only when complete (written to a temporary sibling, then renamed). Files over `shard_size`
    bytes are split into HF-style shards with an index; `workers` threads generate chunks (the
    bytes do not depend on it).
    """
    config = preset_config(preset, scale, dtype=dtype, init_std=init_std)
    if not init_std > 0:
        raise EdgeMTPError(f"init_std must be positive, got {init_std}")
    if shard_size <= 0:
        raise EdgeMTPError(f"shard_size must be positive, got {shard_size}")
    out_dir = Path(out_dir)
    replacing = out_dir.is_dir() and any(out_dir.iterdir())
    if replacing and overwrite and not (out_dir / "config.json").is_file():
        raise EdgeMTPError(f"{out_dir} is not a checkpoint folder; refusing to overwrite it")
    if out_dir.exists() and (not out_dir.is_dir() or (replacing and not overwrite)):
        raise EdgeMTPError(
            f"{out_dir} already exists and is not empty; choose a new folder or pass --force"
        )
    say = progress or (lambda _msg: None)
    specs = tensor_specs(config)
    total = sum(s.nbytes(dtype) for s in specs)
    entries = [TensorEntry(s.name, s.st_dtype(dtype), tuple(s.shape)) for s in specs]
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    workers = workers or max(1, min(4, os.cpu_count() or 1))
    try:
        with ThreadPoolExecutor(workers) as pool:
            produce = _producer(specs, seed, dtype, init_std, pool, workers + 1)
            write_tensors(tmp, entries, produce, shard_bytes=shard_size, progress=say)
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", _generation_config(config))
        tmp.chmod(0o755)
        if out_dir.exists():  # empty, or a checkpoint we were asked to overwrite
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    say(f"wrote {preset} (scale {scale}) to {out_dir}: {total / 2**30:.2f} GiB")
    return out_dir


def _generation_config(config: dict[str, Any]) -> dict[str, Any]:
    text = config.get("text_config", config)
    gen: dict[str, Any] = {
        "bos_token_id": text["bos_token_id"],
        "eos_token_id": text["eos_token_id"],
        "pad_token_id": text["pad_token_id"],
        "transformers_version": TRANSFORMERS_LAYOUT_VERSION,
    }
    if config.get("model_type") == "gemma4_assistant":
        gen["num_assistant_tokens"] = 2
    return gen


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
