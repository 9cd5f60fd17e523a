"""Analytic work of a target forward: FLOPs per layer from the config's shapes.

Used to say what a pruning or a depth *should* buy before measuring it (and, later, by the
simulator). Counts matmul FLOPs (2 per multiply-add); norms, RoPE and activations are ignored.
"""

from __future__ import annotations

from edgemtp.model.config import LayerSpec, TextConfig


def attended(spec: LayerSpec, cfg: TextConfig, position: int) -> int:
    """How many keys a query at `position` attends to in this layer."""
    if spec.attention == "sliding":
        return min(position + 1, cfg.sliding_window)
    return position + 1


def layer_flops(cfg: TextConfig, spec: LayerSpec, positions: range) -> float:
    """FLOPs of one decoder layer for query rows at `positions`."""
    h, heads, hd = cfg.hidden_size, cfg.num_heads, spec.head_dim
    per_row = 2 * h * heads * hd * 2  # q_proj, o_proj
    if spec.owns_kv:
        per_row += 2 * h * spec.num_kv_heads * hd * (1 if spec.k_eq_v else 2)
    per_row += 2 * 3 * h * spec.intermediate_size
    if cfg.hidden_size_per_layer_input:
        per_row += 2 * 2 * h * cfg.hidden_size_per_layer_input
    scores = sum(attended(spec, cfg, p) for p in positions) * heads * hd * 2 * 2  # QK^T and PV
    return per_row * len(positions) + scores


def prefill_flops(cfg: TextConfig, length: int, chunk: int, prune: bool) -> float:
    """FLOPs of a chunked prefill of `length` tokens (LM head on the last row only)."""
    total = 0.0
    for start in range(0, length, chunk):
        rows = range(start, min(start + chunk, length))
        last = rows.stop == length
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
