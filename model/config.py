"""Gemma 4 text and assistant configurations, parsed from Hugging Face `config.json` dicts.

Both serialisations transformers has used are accepted: per-layer overrides in `per_layer_config`
(keys are layer indices) or the older `global_head_dim` / `num_global_key_value_heads` pair.
Every layer is resolved once into a `LayerSpec`, so nothing downstream re-derives shapes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from edgemtp.errors import EdgeMTPError, malformed_input

# The dtypes a KV cache can be stored in (`--kv-cache`); model/cache.py maps them to torch.
KV_CACHE_KINDS = ("fp32", "fp16", "int8")

AttentionKind = Literal["sliding", "full"]
KVRole = Literal["own", "store", "reuse"]

MAX_LAYERS = 1024  # Gemma 4 has at most a few dozen; a larger count is a corrupt file
_HF_LAYER_TYPES = {"sliding_attention": "sliding", "full_attention": "full"}
ASSISTANT_MODEL_TYPE = "gemma4_assistant"


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    partial_rotary_factor: float = 1.0
    proportional: bool = (
        False  # "proportional": inv_freq over the full head_dim, zeros past the rotary part
    )
    factor: float = 1.0


@dataclass(frozen=True)
class LayerSpec:
    index: int
    attention: AttentionKind
    head_dim: int
    num_kv_heads: int
    kv_role: KVRole  # own: has K/V and a cache; store: owns a cache others reuse; reuse: reads one
    kv_source: int  # the layer whose cache this layer attends to (itself unless it reuses)
    intermediate_size: int
    k_eq_v: bool  # V is the K projection (before k_norm and RoPE)

    @property
    def owns_kv(self) -> bool:
        return self.kv_role != "reuse"


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    layer_types: tuple[AttentionKind, ...]
    layers: tuple[LayerSpec, ...]
    rope: dict[str, RopeSpec]
    sliding_window: int
    rms_norm_eps: float = 1e-6
    final_logit_softcapping: float | None = None
    hidden_size_per_layer_input: int = 0
    vocab_size_per_layer_input: int = 0
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = False
    max_position_embeddings: int = 131072
    eos_token_ids: tuple[int, ...] = (1,)
    bos_token_id: int | None = 2
    pad_token_id: int | None = 0
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def first_shared_layer(self) -> int:
        return self.num_layers - self.num_kv_shared_layers

    @property
    def last_owning_layer(self) -> int:
        """The last layer that writes a cache: in a pruned prefill, the one whose K/V every row
        needs but whose output only the rows the KV-shared layers see."""
        return min(self.first_shared_layer, self.num_layers) - 1

    @property
    def store_layers(self) -> dict[str, int]:
        """Attention kind -> the layer whose cache the KV-shared layers of that kind read."""
        return {spec.attention: spec.index for spec in self.layers if spec.kv_role == "store"}

    def head_dim_of(self, kind: AttentionKind) -> int:
        return next(spec.head_dim for spec in self.layers if spec.attention == kind)

    def kv_heads_of(self, kind: AttentionKind) -> int:
        return next(spec.num_kv_heads for spec in self.layers if spec.attention == kind)


@dataclass(frozen=True)
class AssistantConfig:
    text: TextConfig
    backbone_hidden_size: int
    use_ordered_embeddings: bool
    num_centroids: int
    centroid_top_k: int
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def tokens_per_centroid(self) -> int:
        return self.text.vocab_size // self.num_centroids


def _require(cfg: dict[str, Any], key: str, where: str) -> Any:
    if key not in cfg:
        raise EdgeMTPError(f"{where}: config has no '{key}'; is this a Gemma 4 config.json?")
    return cfg[key]


def _rope_specs(cfg: dict[str, Any], where: str) -> dict[str, RopeSpec]:
    params = cfg.get("rope_parameters") or {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {
            "rope_type": "proportional",
            "partial_rotary_factor": 0.25,
            "rope_theta": 1_000_000.0,
        },
    }
    specs: dict[str, RopeSpec] = {}
    for hf_kind, kind in _HF_LAYER_TYPES.items():
        p = params.get(hf_kind)
        if p is None:
            continue
        rope_type = p.get("rope_type", "default")
        if rope_type not in ("default", "proportional"):
            raise EdgeMTPError(
                f"{where}: rope_type '{rope_type}' for {hf_kind} is not supported "
                "(supported: default, proportional)"
            )
        specs[kind] = RopeSpec(
            theta=float(p["rope_theta"]),
            partial_rotary_factor=float(p.get("partial_rotary_factor", 1.0)),
            proportional=rope_type == "proportional",
            factor=float(p.get("factor", 1.0)),
        )
    return specs


def _layer_overrides(cfg: dict[str, Any], layer_types: list[str]) -> dict[int, dict[str, Any]]:
    per_layer = cfg.get("per_layer_config")
    if per_layer is not None:
        return {int(k): dict(v) for k, v in per_layer.items()}
    # Older serialisation: one head_dim (and, with k_eq_v, a KV-head count) for every full layer.
    overrides: dict[str, Any] = {"head_dim": int(cfg.get("global_head_dim", 512))}
    global_kv = cfg.get("num_global_key_value_heads")
    if global_kv is not None and cfg.get("attention_k_eq_v", False):
        overrides["num_key_value_heads"] = int(global_kv)
    return {i: overrides for i, t in enumerate(layer_types) if t == "full_attention"}


def _kv_roles(layer_types: list[str], num_shared: int, where: str) -> list[tuple[KVRole, int]]:
    n = len(layer_types)
    if num_shared == n:  # an assistant: every layer reads the target's caches
        return [("reuse", -1)] * n
    first_shared = n - num_shared
    roles: list[tuple[KVRole, int]] = [("own", i) for i in range(n)]
    store_of: dict[str, int] = {}
    for kind in sorted(set(layer_types)):
        owners = [i for i in range(first_shared) if layer_types[i] == kind]
        if not owners:
            raise EdgeMTPError(
                f"{where}: KV-shared {kind} layers have no earlier {kind} layer to reuse; "
                "num_kv_shared_layers is too large for this layer pattern"
            )
        store_of[kind] = owners[-1]
    if num_shared:
        for i in store_of.values():
            roles[i] = ("store", i)
        for i in range(first_shared, n):
            roles[i] = ("reuse", store_of[layer_types[i]])
    return roles


_FIX = "fix config.json or download the model again"


def parse_text_config(cfg: dict[str, Any], where: str = "config.json") -> TextConfig:
    """Build a TextConfig from the text part of a Gemma 4 config (`gemma4_text` dict)."""
    with malformed_input(where, "Gemma 4 text config", _FIX):
        return _parse_text_config(cfg, where)


def _parse_text_config(cfg: dict[str, Any], where: str) -> TextConfig:
    model_type = cfg.get("model_type", "gemma4_text")
    if model_type != "gemma4_text":
        raise EdgeMTPError(f"{where}: model_type '{model_type}' is not a Gemma 4 text decoder")
    if cfg.get("enable_moe_block"):
        raise EdgeMTPError(
            f"{where}: Mixture-of-Experts Gemma 4 models are not supported; "
            "edgemtp targets the dense edge models (E2B, E4B)"
        )
    if cfg.get("use_bidirectional_attention"):
        raise EdgeMTPError(f"{where}: bidirectional attention is not supported for decoding")
    num_layers = int(_require(cfg, "num_hidden_layers", where))
    if not 0 < num_layers <= MAX_LAYERS:
        raise EdgeMTPError(f"{where}: num_hidden_layers {num_layers} is not in 1..{MAX_LAYERS}")
    hf_types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(num_layers)
    ]
    if len(hf_types) != num_layers:
        raise EdgeMTPError(
            f"{where}: layer_types has {len(hf_types)} entries, num_hidden_layers is {num_layers}"
        )
    hf_types = list(hf_types)
    hf_types[-1] = "full_attention"  # transformers forces the last layer to full attention
    unknown = sorted(set(hf_types) - set(_HF_LAYER_TYPES))
    if unknown:
        raise EdgeMTPError(f"{where}: unknown layer types {unknown}")

    num_shared = int(cfg.get("num_kv_shared_layers", 0) or 0)
    if not 0 <= num_shared <= num_layers:
        raise EdgeMTPError(f"{where}: num_kv_shared_layers={num_shared} is out of range")
    roles = _kv_roles(hf_types, num_shared, where)
    overrides = _layer_overrides(cfg, hf_types)
    hidden = int(_require(cfg, "hidden_size", where))
    heads = int(_require(cfg, "num_attention_heads", where))
    base_head_dim = int(cfg.get("head_dim") or hidden // heads)
    base_kv_heads = int(cfg.get("num_key_value_heads", heads))
    intermediate = int(_require(cfg, "intermediate_size", where))
    double_wide = bool(cfg.get("use_double_wide_mlp", False))
    k_eq_v = bool(cfg.get("attention_k_eq_v", False))

    layers = []
    for i, hf_type in enumerate(hf_types):
        kind = _HF_LAYER_TYPES[hf_type]
        over = overrides.get(i, {})
        role, source = roles[i]
        spec = LayerSpec(
            index=i,
            attention=kind,  # type: ignore[arg-type]
            head_dim=int(over.get("head_dim", base_head_dim)),
            num_kv_heads=int(over.get("num_key_value_heads", base_kv_heads)),
            kv_role=role,
            kv_source=source,
            intermediate_size=intermediate * (2 if double_wide and role == "reuse" else 1),
            k_eq_v=k_eq_v and kind == "full",
        )
        if spec.num_kv_heads <= 0 or spec.head_dim <= 0 or heads % spec.num_kv_heads:
            raise EdgeMTPError(
                f"{where}: layer {i} has {spec.num_kv_heads} KV heads of dimension "
                f"{spec.head_dim}: they must be positive and divide {heads} attention heads"
            )
        layers.append(spec)
    for kind in sorted(set(_HF_LAYER_TYPES.values())):
        dims = {(s.head_dim, s.num_kv_heads) for s in layers if s.attention == kind}
        if len(dims) > 1:
            raise EdgeMTPError(
                f"{where}: {kind} layers disagree on (head_dim, kv_heads): {sorted(dims)}"
            )

    rope = _rope_specs(cfg, where)
    for kind in {s.attention for s in layers}:
        if kind not in rope:
            raise EdgeMTPError(f"{where}: rope_parameters has no entry for {kind}_attention")
    eos = cfg.get("eos_token_id", 1)
    eos_ids = tuple(
        int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else [])
    )
    ple = int(cfg.get("hidden_size_per_layer_input", 0) or 0)
    return TextConfig(
        vocab_size=int(_require(cfg, "vocab_size", where)),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=num_layers,
        num_heads=heads,
        layer_types=tuple(s.attention for s in layers),
        layers=tuple(layers),
        rope=rope,
        sliding_window=int(cfg.get("sliding_window", 512)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        hidden_size_per_layer_input=ple,
        vocab_size_per_layer_input=int(cfg.get("vocab_size_per_layer_input", 0) or 0) if ple else 0,
        num_kv_shared_layers=num_shared,
        use_double_wide_mlp=double_wide,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 131072)),
        eos_token_ids=eos_ids,
        bos_token_id=cfg.get("bos_token_id"),
        pad_token_id=cfg.get("pad_token_id"),
        raw=cfg,
    )


def parse_assistant_config(cfg: dict[str, Any], where: str = "config.json") -> AssistantConfig:
    """Build an AssistantConfig from a Gemma 4 assistant's config.json dict."""
    with malformed_input(where, "Gemma 4 assistant config", _FIX):
        return _parse_assistant_config(cfg, where)


def _parse_assistant_config(cfg: dict[str, Any], where: str) -> AssistantConfig:
    text_cfg = dict(_require(cfg, "text_config", where))
    text_cfg.setdefault("model_type", "gemma4_text")
    if not text_cfg.get("num_kv_shared_layers"):
        text_cfg["num_kv_shared_layers"] = text_cfg.get("num_hidden_layers")
    text = parse_text_config(text_cfg, where + " (text_config)")
    if text.num_kv_shared_layers != text.num_layers:
        raise EdgeMTPError(f"{where}: every layer of a Gemma 4 assistant must be KV-shared")
    if text.hidden_size_per_layer_input:
        raise EdgeMTPError(f"{where}: a Gemma 4 assistant has no per-layer embeddings")
    ordered = bool(cfg.get("use_ordered_embeddings", False))
    centroids = int(cfg.get("num_centroids", 2048))
    top_k = int(cfg.get("centroid_intermediate_top_k", 32))
    if ordered and (text.vocab_size % centroids or not 0 < top_k <= centroids):
        raise EdgeMTPError(
            f"{where}: clustered head needs vocab_size ({text.vocab_size}) divisible by "
            f"num_centroids ({centroids}) and 0 < top_k ({top_k}) <= num_centroids"
        )
    return AssistantConfig(
        text=text,
        backbone_hidden_size=int(_require(cfg, "backbone_hidden_size", where)),
        use_ordered_embeddings=ordered,
        num_centroids=centroids,
        centroid_top_k=top_k,
        raw=cfg,
    )


def read_config_json(model_dir: Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).exists():
        raise EdgeMTPError(f"{model_dir}: no such directory; pass a Hugging Face model folder")
    if not path.is_file():
        raise EdgeMTPError(f"{model_dir}: no config.json; pass a Hugging Face model folder")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise EdgeMTPError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(cfg, dict):
        raise EdgeMTPError(f"{path}: expected a JSON object")
    return cfg


def check_drafter_matches(target: TextConfig, drafter: AssistantConfig) -> None:
    """Raise naming the first mismatch between a target and an assistant drafter."""
    problems = []
    if drafter.backbone_hidden_size != target.hidden_size:
        problems.append(
            f"drafter backbone_hidden_size {drafter.backbone_hidden_size} "
            f"!= target hidden_size {target.hidden_size}"
        )
    if drafter.text.vocab_size != target.vocab_size:
        problems.append(
            f"drafter vocab_size {drafter.text.vocab_size} != target vocab_size {target.vocab_size}"
        )
    stores = target.store_layers
    for kind in sorted(set(drafter.text.layer_types)):
        if kind not in stores:
            problems.append(f"target has no KV-sharing store layer for {kind} attention")
            continue
        store = target.layers[stores[kind]]
        if drafter.text.head_dim_of(kind) != store.head_dim:
            problems.append(
                f"{kind} head_dim: drafter {drafter.text.head_dim_of(kind)} "
                f"!= target store layer {store.index} {store.head_dim}"
            )
        if drafter.text.kv_heads_of(kind) != store.num_kv_heads:
            problems.append(
                f"{kind} KV heads: drafter {drafter.text.kv_heads_of(kind)} "
                f"!= target store layer {store.index} {store.num_kv_heads}"
            )
    if (
        drafter.text.sliding_window != target.sliding_window
        and "sliding" in drafter.text.layer_types
    ):
        problems.append(
            f"sliding_window: drafter {drafter.text.sliding_window} "
            f"!= target {target.sliding_window}"
        )
    if problems:
        raise EdgeMTPError(
            "drafter does not match this target: "
            + "; ".join(problems)
            + " (use the assistant trained for this target, or distill one)"
        )


def parameter_count(text: TextConfig) -> int:
    """Parameters of a target text model (embedding tables included, tied head counted once)."""
    h = text.hidden_size
    total = text.vocab_size * h + h  # token table, final norm
    if text.hidden_size_per_layer_input:
        p, n = text.hidden_size_per_layer_input, text.num_layers
        total += text.vocab_size_per_layer_input * n * p + h * n * p + p
    for spec in text.layers:
        q = text.num_heads * spec.head_dim
        kv = spec.num_kv_heads * spec.head_dim
        total += h * q + q * h + spec.head_dim  # q, o, q_norm
        if spec.owns_kv:
            total += h * kv * (1 if spec.k_eq_v else 2) + spec.head_dim
        total += 3 * h * spec.intermediate_size + 4 * h + 1
        if text.hidden_size_per_layer_input:
            total += 2 * h * text.hidden_size_per_layer_input + h
    return total
