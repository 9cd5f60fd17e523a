"""Analytic work of the target and drafter from the config's shapes: FLOPs per layer, and the
bytes, FLOPs and attention scores of one program call (`Work`, the simulator's input).

Says what a pruning or a depth *should* buy before measuring it. Counts matmul FLOPs (2 per
multiply-add); norms, RoPE and activations are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

from edgemtp.model.cache import row_width
from edgemtp.model.config import AssistantConfig, LayerSpec, TextConfig
from edgemtp.model.forward import prefill_chunks


def attended(spec: LayerSpec, cfg: TextConfig, position: int) -> int:
    """How many keys a query at `position` attends to in this layer."""
    if spec.attention == "sliding":
        return min(position + 1, cfg.sliding_window)
    return position + 1


def layer_flops(
    cfg: TextConfig, spec: LayerSpec, positions: range, keys: int | None = None
) -> float:
    """FLOPs of one decoder layer for query rows at `positions`. Each row attends to the keys
    before it, or, in a static program, to `keys` keys (every cache slot its method reads and
    the call's own rows)."""
    h, heads, hd = cfg.hidden_size, cfg.num_heads, spec.head_dim
    per_row = 2 * h * heads * hd * 2  # q_proj, o_proj
    per_row += 2 * kv_projection_weights(cfg, spec)
    per_row += 2 * 3 * h * spec.intermediate_size
    if cfg.hidden_size_per_layer_input:
        per_row += 2 * 2 * h * cfg.hidden_size_per_layer_input
    return per_row * len(positions) + attention_flops(cfg, spec, positions, keys)


def attention_scores(
    cfg: TextConfig, spec: LayerSpec, positions: range, keys: int | None = None
) -> float:
    """Attention scores (one per head, row and key read) of one layer: the elements its mask,
    softmax and probabilities pass over between the two matmuls."""
    total = (
        sum(attended(spec, cfg, p) for p in positions) if keys is None else keys * len(positions)
    )
    return total * cfg.num_heads


def attention_flops(
    cfg: TextConfig, spec: LayerSpec, positions: range, keys: int | None = None
) -> float:
    """The part of `layer_flops` between activations: QK^T and PV over the keys each row reads."""
    return attention_scores(cfg, spec, positions, keys) * spec.head_dim * 2 * 2


def prefill_flops(cfg: TextConfig, length: int, chunk: int, prune: bool) -> float:
    """FLOPs of a chunked prefill of `length` tokens (LM head on the last row only)."""
    total = 0.0
    for start, end in prefill_chunks(length, chunk):
        rows = range(start, end)
        last = end == length
        for spec in cfg.layers:
            if prune and spec.index >= cfg.first_shared_layer:
                if not last:
                    continue
                total += layer_flops(cfg, spec, range(rows.stop - 1, rows.stop))
            else:
                total += layer_flops(cfg, spec, rows)
        if cfg.hidden_size_per_layer_input:
            total += (
                2 * cfg.hidden_size * cfg.num_layers * cfg.hidden_size_per_layer_input * len(rows)
            )
    return total + 2 * cfg.hidden_size * cfg.vocab_size


# --- bytes and FLOPs of one program call (the simulator's input) ------------------------------

BITS_PER_WEIGHT = {"q4_0": 4.5, "w4a16": 4.0 + 16 / 128, "int8": 8.0, "fp16": 16.0, "fp32": 32.0}


@dataclass(frozen=True)
class Work:
    """What one call of a method moves and computes: weight bytes read (once per call, however
    many rows), K/V bytes read, matmul FLOPs (of which `attention_flops` multiply activations
    by activations, in the activation dtype), attention scores (`attention_scores`), and how
    many rows it carries. Of the weights and linear FLOPs, `few_rows_bytes` and
    `few_rows_flops` are those of linears that run on fewer rows than the call carries (a
    pruned prefill's KV-shared layers and head): their kernels stream weights while the others
    compute, so a call prices the two apart. `linear_elements`: the activation elements its
    linears read and write (rows x (inputs + outputs) each), what a GEMM pays for beside its
    FLOPs (quantizing its input rows, writing its output)."""

    flops: float = 0.0
    weight_bytes: float = 0.0
    cache_bytes: float = 0.0
    rows: int = 0
    attention_flops: float = 0.0
    scores: float = 0.0
    few_rows_bytes: float = 0.0
    few_rows_flops: float = 0.0
    linear_elements: float = 0.0

    def __add__(self, other: Work) -> Work:
        return Work(
            self.flops + other.flops,
            self.weight_bytes + other.weight_bytes,
            self.cache_bytes + other.cache_bytes,
            max(self.rows, other.rows),
            self.attention_flops + other.attention_flops,
            self.scores + other.scores,
            self.few_rows_bytes + other.few_rows_bytes,
            self.few_rows_flops + other.few_rows_flops,
            self.linear_elements + other.linear_elements,
        )

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.cache_bytes


def kv_projection_weights(cfg: TextConfig, spec: LayerSpec) -> int:
    """Weights of a layer's k_proj and v_proj (none where it reuses another layer's cache)."""
    if not spec.owns_kv:
        return 0
    return cfg.hidden_size * spec.num_kv_heads * spec.head_dim * (1 if spec.k_eq_v else 2)


def layer_weights(cfg: TextConfig, spec: LayerSpec) -> int:
    """Linear weights of one decoder layer (attention, MLP, per-layer input gate)."""
    h, hd = cfg.hidden_size, spec.head_dim
    n = 2 * h * cfg.num_heads * hd  # q_proj, o_proj
    n += kv_projection_weights(cfg, spec)
    n += 3 * h * spec.intermediate_size
    if cfg.hidden_size_per_layer_input:
        n += 2 * h * cfg.hidden_size_per_layer_input
    return n


def layer_linear_elements(cfg: TextConfig, spec: LayerSpec) -> int:
    """Activation elements one row takes through a decoder layer's linears: each linear's
    inputs and outputs (the K/V projections' apart: `kv_projection_elements`)."""
    h, q = cfg.hidden_size, cfg.num_heads * spec.head_dim
    n = 2 * (h + q)  # q_proj, o_proj
    n += kv_projection_elements(cfg, spec)
    n += 3 * (h + spec.intermediate_size)
    if cfg.hidden_size_per_layer_input:
        n += 2 * (h + cfg.hidden_size_per_layer_input)
    return n


def kv_projection_elements(cfg: TextConfig, spec: LayerSpec) -> int:
    """One row's activation elements through a layer's k_proj and v_proj (none where it reuses
    another layer's cache)."""
    if not spec.owns_kv:
        return 0
    return (cfg.hidden_size + spec.num_kv_heads * spec.head_dim) * (1 if spec.k_eq_v else 2)


def kv_read_bytes(
    cfg: TextConfig, spec: LayerSpec, positions: range, cache_keys: int | None, itemsize: int = 4
) -> int:
    """K and V bytes this layer reads from its source cache for rows at `positions`: each row
    its own keys, or, in a static program, the `cache_keys` slots its method reads, once."""
    source = cfg.layers[spec.kv_source]
    if cache_keys is None:
        keys = sum(attended(spec, cfg, p) for p in positions)
    else:
        keys = cache_keys
    return 2 * keys * source.num_kv_heads * row_width(source.head_dim, itemsize) * itemsize


def static_cache_keys(slots: dict[str, int], bucket: int | None = None) -> dict[str, int]:
    """Cache keys a static method reads per attention kind: every slot and the trash slot, or
    the first `bucket` slots of a cache at least twice as long (`StaticCache.view`)."""
    return {
        kind: bucket if bucket is not None and 2 * bucket <= n else n + 1
        for kind, n in slots.items()
    }


def forward_work(
    cfg: TextConfig,
    positions: range,
    shared_rows: int,
    logits_rows: int,
    bits: float,
    cache_keys: dict[str, int] | None = None,
    cache_itemsize: int = 4,
) -> Work:
    """One target call over rows at `positions`: the owning layers for every row, the KV-shared
    layers for the last `shared_rows` rows (fewer than all: a pruned prefill, whose last owning
    layer also computes only K/V for the other rows, as `Gemma4Target.forward` does), the LM
    head for `logits_rows` rows. Each weight is read once per call; the K/V as
    `kv_read_bytes` says (`cache_keys`: what a static program's method reads per attention
    kind, `static_cache_keys`; None: only what each row attends to). A KV-shared layer's rows
    also attend to all the call's rows."""
    work = Work(rows=len(positions))
    pruned = shared_rows < len(positions)
    for spec in cfg.layers:
        shared = spec.index >= cfg.first_shared_layer
        if pruned and spec.index == cfg.last_owning_layer:
            kv = kv_projection_weights(cfg, spec)  # for every row; the rest as a shared layer's
            kv_elements = kv_projection_elements(cfg, spec) * len(positions)
            work += Work(2 * kv * len(positions), kv * bits / 8, linear_elements=kv_elements)
            shared = True
        rows = positions[len(positions) - shared_rows :] if shared else positions
        if not rows:
            continue
        n = None if cache_keys is None else cache_keys[spec.attention]
        keys = None if n is None else n + len(positions)
        cache = kv_read_bytes(cfg, spec, rows, n, cache_itemsize)
        weights = layer_weights(cfg, spec)
        flops = layer_flops(cfg, spec, rows, keys)
        elements = layer_linear_elements(cfg, spec)
        if pruned and spec.index == cfg.last_owning_layer:
            weights -= kv_projection_weights(cfg, spec)
            flops -= 2 * kv_projection_weights(cfg, spec) * len(rows)
            elements -= kv_projection_elements(cfg, spec)
        attention = attention_flops(cfg, spec, rows, keys)
        scores = attention_scores(cfg, spec, rows, keys)
        elements *= len(rows)
        work += Work(
            flops, weights * bits / 8, cache, 0, attention, scores, linear_elements=elements
        )
        if len(rows) < len(positions):
            work += Work(few_rows_bytes=weights * bits / 8, few_rows_flops=flops - attention)
    if cfg.hidden_size_per_layer_input:  # the per-layer input projection (model level)
        out = cfg.num_layers * cfg.hidden_size_per_layer_input
        n, elements = cfg.hidden_size * out, (cfg.hidden_size + out) * len(positions)
        work += Work(2 * n * len(positions), n * bits / 8, linear_elements=elements)
    if logits_rows:
        head = cfg.hidden_size * cfg.vocab_size
        elements = (cfg.hidden_size + cfg.vocab_size) * logits_rows
        work += Work(2 * head * logits_rows, head * bits / 8, linear_elements=elements)
        if logits_rows < len(positions):
            work += Work(few_rows_bytes=head * bits / 8, few_rows_flops=2 * head * logits_rows)
    return work


def draft_work(
    drafter: AssistantConfig,
    target: TextConfig,
    position: int,
    bits: float,
    cache_keys: dict[str, int] | None = None,
    full_head: bool = False,
    itemsize: int = 4,
) -> Work:
    """One drafter step at `position`: its projections and layers (reading the target's store
    caches: what it attends to, or every slot in a static program) and its head: clustered
    (centroids + the top-k clusters' rows), or every vocabulary row (a dense head, or an int4
    clustered head that computes them all and keeps the top clusters' logits)."""
    text, backbone = drafter.text, drafter.backbone_hidden_size
    n = 2 * backbone * text.hidden_size + text.hidden_size * backbone  # pre/post projections
    elements = 2 * backbone + text.hidden_size + text.hidden_size + backbone
    work = Work(2 * n, n * bits / 8, rows=1, linear_elements=elements)
    stores = target.store_layers
    for spec in text.layers:
        store = target.layers[stores[spec.attention]]
        keys = None if cache_keys is None else cache_keys[spec.attention]
        read = attended(spec, text, position) if keys is None else keys
        cache = 2 * read * store.num_kv_heads * row_width(store.head_dim, itemsize) * itemsize
        row = range(position, position + 1)
        flops, attention, scores = (
            layer_flops(text, spec, row, keys),
            attention_flops(text, spec, row, keys),
            attention_scores(text, spec, row, keys),
        )
        weights, elements = layer_weights(text, spec), layer_linear_elements(text, spec)
        work += Work(
            flops, weights * bits / 8, cache, 0, attention, scores, linear_elements=elements
        )
    h = text.hidden_size
    if not drafter.use_ordered_embeddings:
        rows = text.vocab_size
    elif full_head:
        rows = drafter.num_centroids + text.vocab_size
    else:
        rows = drafter.num_centroids + drafter.centroid_top_k * drafter.tokens_per_centroid
    elements = h + rows + (h if drafter.use_ordered_embeddings else 0)  # centroids, then rows
    return work + Work(2 * h * rows, h * rows * bits / 8, linear_elements=elements)
