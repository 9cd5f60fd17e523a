"""Tiny random Gemma 4 checkpoints built with transformers (the oracle), saved in HF layout."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    Gemma4AssistantConfig,
    Gemma4AssistantForCausalLM,
    Gemma4ForCausalLM,
    Gemma4TextConfig,
)


def layer_types(pattern: int, n: int) -> list[str]:
    """`pattern` sliding layers then one full, repeated; the last layer is full."""
    types = [
        "full_attention" if (i + 1) % (pattern + 1) == 0 else "sliding_attention" for i in range(n)
    ]
    types[-1] = "full_attention"
    return types


def target_config(**overrides) -> Gemma4TextConfig:
    kw = dict(
        num_hidden_layers=7,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        global_head_dim=32,
        vocab_size=128,
        vocab_size_per_layer_input=128,
        hidden_size_per_layer_input=8,
        num_kv_shared_layers=3,
        use_double_wide_mlp=True,
        sliding_window=8,
        final_logit_softcapping=30.0,
        initializer_range=0.05,
    )
    kw.update(overrides)
    kw.setdefault("layer_types", layer_types(2, kw["num_hidden_layers"]))
    return Gemma4TextConfig(**kw)


def assistant_config(
    target: Gemma4TextConfig, ordered: bool = True, **text_overrides
) -> Gemma4AssistantConfig:
    sliding = target.per_layer_config[target.layer_types.index("sliding_attention")]
    full = target.per_layer_config[target.layer_types.index("full_attention")]
    text = dict(
        model_type="gemma4_text",
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=2,
        num_key_value_heads=sliding.num_key_value_heads,
        head_dim=sliding.head_dim,
        global_head_dim=full.head_dim,
        vocab_size=target.vocab_size,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=target.sliding_window,
        initializer_range=0.05,
    )
    if full.num_key_value_heads != sliding.num_key_value_heads:
        text["per_layer_config"] = {
            "1": {"head_dim": full.head_dim, "num_key_value_heads": full.num_key_value_heads}
        }
    text.update(text_overrides)
    return Gemma4AssistantConfig(
        text_config=text,
        backbone_hidden_size=target.hidden_size,
        use_ordered_embeddings=ordered,
        num_centroids=8,
        centroid_intermediate_top_k=3,
    )


def build_target(path: Path, seed: int = 0, **overrides) -> Gemma4ForCausalLM:
    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(target_config(**overrides)).eval()
    model.save_pretrained(path)
    return model


def build_assistant(
    path: Path, target: Gemma4TextConfig, seed: int = 1, ordered: bool = True, **text_overrides
) -> Gemma4AssistantForCausalLM:
    torch.manual_seed(seed)
    model = Gemma4AssistantForCausalLM(assistant_config(target, ordered, **text_overrides)).eval()
    if ordered:
        model.masked_embedding.token_ordering.copy_(torch.randperm(target.vocab_size))
    model.generation_config.num_assistant_tokens = 2
    model.save_pretrained(path)
    return model
