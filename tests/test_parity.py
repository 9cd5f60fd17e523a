"""Our model code against transformers' Gemma4ForCausalLM / Gemma4AssistantForCausalLM (fp32)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from hf_oracle import build_assistant, build_target, layer_types
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from edgemtp.model.cache import KVCache
from edgemtp.quantize.load import load_drafter, load_target

TOL = 1e-4


@st.composite
def tiny_configs(draw):
    pattern = draw(st.integers(1, 4))
    n_layers = draw(st.integers(pattern + 2, 9))
    types = layer_types(pattern, n_layers)
    # shared layers need an earlier layer of each kind they use
    max_shared = 0
    for shared in range(n_layers):
        first = n_layers - shared
        if set(types[first:]) <= set(types[:first]):
            max_shared = shared
    shared = draw(st.integers(0, max_shared))
    kv_heads = draw(st.sampled_from([1, 2, 4]))
    k_eq_v = draw(st.booleans())
    ple = draw(st.sampled_from([0, 8]))
    cfg = dict(
        num_hidden_layers=n_layers,
        layer_types=types,
        num_kv_shared_layers=shared,
        num_key_value_heads=kv_heads,
        attention_k_eq_v=k_eq_v,
        use_double_wide_mlp=draw(st.booleans()),
        final_logit_softcapping=draw(st.sampled_from([None, 30.0])),
        hidden_size_per_layer_input=ple,
        vocab_size_per_layer_input=128 if ple else 0,
        sliding_window=draw(st.sampled_from([4, 8, 64])),
    )
    if k_eq_v:
        cfg["num_global_key_value_heads"] = draw(st.sampled_from([1, 2]))
    return cfg, draw(st.integers(0, 2**16))


def full_vocab_logits(ids: torch.Tensor | None, logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Clustered logits scattered into the vocabulary, the rest one below the smallest kept
    logit (the reference's representation)."""
    if ids is None:
        return logits
    out = torch.full((vocab,), logits.min().item() - 1.0, dtype=logits.dtype)
    return out.scatter(0, ids, logits)


def _ours(target, ids: torch.Tensor, cache: KVCache, rows: str = "all"):
    start = cache.length
    positions = torch.arange(start, start + ids.shape[0])
    hidden, new_kv = target.model(
        target.tables.embed(ids), target.tables.per_layer_inputs(ids), positions, cache, rows
    )
    cache.write(new_kv, start)
    return hidden, target.model.logits(hidden)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tiny_configs())
def test_prefill_and_decode_logits_match_transformers(case):
    overrides, seed = case
    with tempfile.TemporaryDirectory() as tmp:
        hf = build_target(Path(tmp), seed=seed, **overrides)
        ours = load_target(Path(tmp))
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (20,), generator=gen)
    prompt, rest = ids[:12], ids[12:]

    hf_cache = DynamicCache(config=hf.config)
    # output_hidden_states keeps transformers off its own shared-layer slicing, which crashes
    # without PLE (BRIEF §9)
    ref = hf(prompt[None], cache=hf_cache, use_cache=True, output_hidden_states=True).logits[0]
    cache = KVCache(ours.cfg, 64)
    _, got = _ours(ours, prompt, cache)
    assert (ref - got).abs().max() <= TOL

    for token in rest:
        ref = hf(
            token.view(1, 1), cache=hf_cache, use_cache=True, output_hidden_states=True
        ).logits[0, -1]
        _, got = _ours(ours, token.view(1), cache)
        assert (ref - got[-1]).abs().max() <= TOL


def test_multimodal_layout_and_bf16_load(tmp_path):
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    hf_text = build_target(tmp_path / "text")
    mm_cfg = Gemma4Config(
        text_config=hf_text.config.to_dict(), vision_config=None, audio_config=None
    )
    torch.manual_seed(0)
    mm = Gemma4ForConditionalGeneration(mm_cfg).eval()
    mm.model.language_model.load_state_dict(hf_text.model.state_dict())
    mm.to(torch.bfloat16).save_pretrained(tmp_path / "mm")
    ours = load_target(tmp_path / "mm")
    assert ours.tables.tokens.dtype == torch.bfloat16  # stays in its stored dtype, memory-mapped
    ids = torch.randint(0, 128, (10,))
    oracle = hf_text
    for param in oracle.parameters():  # the weights as stored, computed in fp32
        param.copy_(param.bfloat16().float())
    # transformers scales a bf16 table by the scale rounded to bf16; keep that in the fp32 oracle
    for table in (oracle.model.embed_tokens, oracle.model.embed_tokens_per_layer):
        table.embed_scale.copy_(table.embed_scale.bfloat16().float())
    ref = oracle(ids[None]).logits[0]
    _, got = _ours(ours, ids, KVCache(ours.cfg, 32))
    assert (ref - got).abs().max() <= TOL


def test_sharded_checkpoint_loads(tmp_path):
    hf = build_target(tmp_path / "src")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    ours = load_target(tmp_path / "sharded")
    ids = torch.randint(0, 128, (9,))
    _, got = _ours(ours, ids, KVCache(ours.cfg, 32))
    assert (hf(ids[None]).logits[0] - got).abs().max() <= TOL


def _drafter_case(tmp_path: Path, ordered: bool, prompt_len: int):
    hf_t = build_target(tmp_path / "t", sliding_window=6)
    hf_a = build_assistant(tmp_path / "a", hf_t.config, ordered=ordered)
    target = load_target(tmp_path / "t")
    drafter = load_drafter(tmp_path / "a", target.cfg)
    ids = torch.randint(0, 128, (prompt_len,))
    out = hf_t(ids[None], output_hidden_states=True, return_shared_kv_states=True, use_cache=False)
    token = torch.tensor([[7]])
    ref = hf_a(
        inputs_embeds=torch.cat(
            [hf_t.model.embed_tokens(token), out.hidden_states[-1][:, -1:]], -1
        ),
        position_ids=torch.tensor([[prompt_len]]),
        shared_kv_states=dict(out.shared_kv_states),
    )
    cache = KVCache(target.cfg, 64)
    hidden, _ = _ours(target, ids, cache)
    next_hidden, tok_ids, logits = drafter.model(
        target.tables.embed(torch.tensor([7]))[0], hidden[-1], prompt_len, cache
    )
    return ref, next_hidden, full_vocab_logits(tok_ids, logits, 128), tok_ids


def test_drafter_matches_transformers_dense_head(tmp_path):
    for prompt_len in (3, 7, 8, 19):  # before, at and well past the sliding window (6)
        ref, hidden, logits, ids = _drafter_case(tmp_path / str(prompt_len), False, prompt_len)
        assert ids is None
        assert (ref.last_hidden_state[0, 0] - hidden).abs().max() <= TOL
        assert (ref.logits[0, 0] - logits).abs().max() <= TOL


def test_drafter_matches_transformers_clustered_head(tmp_path):
    for prompt_len in (5, 19):
        ref, hidden, logits, ids = _drafter_case(tmp_path / str(prompt_len), True, prompt_len)
        assert ids.shape == (3 * 128 // 8,)  # top-3 of 8 clusters, 16 tokens each
        assert (ref.last_hidden_state[0, 0] - hidden).abs().max() <= TOL
        assert (ref.logits[0, 0] - logits).abs().max() <= TOL
        assert int(ref.logits[0, 0].argmax()) == int(logits.argmax())
