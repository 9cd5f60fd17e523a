"""Config parsing: both serialisations transformers has used, and the KV-sharing roles."""

from __future__ import annotations

import pytest
from hf_oracle import target_config

from edgemtp.errors import EdgeMTPError
from edgemtp.model.config import parse_text_config


def test_global_head_dim_form_equals_per_layer_config_form():
    for k_eq_v in (False, True):
        hf = target_config(
            attention_k_eq_v=k_eq_v, num_global_key_value_heads=2 if k_eq_v else None
        )
        modern = hf.to_dict()
        assert "per_layer_config" in modern
        legacy = {k: v for k, v in modern.items() if k != "per_layer_config"}
        legacy["global_head_dim"] = 32
        if k_eq_v:
            legacy["num_global_key_value_heads"] = 2
        a, b = parse_text_config(modern), parse_text_config(legacy)
        assert a.layers == b.layers
        full = [s for s in a.layers if s.attention == "full"]
        assert all(s.head_dim == 32 for s in full)
        assert all(s.num_kv_heads == (2 if k_eq_v else 1) for s in full)
        assert all(s.k_eq_v == k_eq_v for s in full)
        assert not any(s.k_eq_v for s in a.layers if s.attention == "sliding")


def test_kv_roles_match_transformers():
    hf = target_config(num_hidden_layers=9, num_kv_shared_layers=4)
    ours = parse_text_config(hf.to_dict())
    roles = {None: "own", "store": "store", "reuse": "reuse"}
    assert [s.kv_role for s in ours.layers] == [roles[m] for m in hf.kv_sharing_modes]
    for spec in ours.layers:
        if spec.kv_role == "reuse":
            store = ours.layers[spec.kv_source]
            assert store.kv_role == "store" and store.attention == spec.attention
    double = [s.intermediate_size for s in ours.layers]
    assert double == [96 if s.kv_role != "reuse" else 192 for s in ours.layers]


def test_unsupported_configs_name_the_problem():
    base = target_config().to_dict()
    with pytest.raises(EdgeMTPError, match="Mixture-of-Experts"):
        parse_text_config({**base, "enable_moe_block": True})
    with pytest.raises(EdgeMTPError, match="num_kv_shared_layers"):
        parse_text_config({**base, "num_kv_shared_layers": 6})  # leaves no full layer to reuse
    with pytest.raises(EdgeMTPError, match="rope_type 'yarn'"):
        rope = {
            **base["rope_parameters"],
            "sliding_attention": {"rope_type": "yarn", "rope_theta": 1.0},
        }
        parse_text_config({**base, "rope_parameters": rope})
    with pytest.raises(EdgeMTPError, match="no 'hidden_size'"):
        parse_text_config({k: v for k, v in base.items() if k != "hidden_size"})
