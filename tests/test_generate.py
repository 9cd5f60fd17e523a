"""The reference engine: greedy vs transformers, MTP vs AR, pruned vs unpruned prefill."""

from __future__ import annotations

import pytest
import torch
from hf_oracle import build_assistant, build_target, target_config
from transformers import Gemma4AssistantForCausalLM, Gemma4ForCausalLM

from edgemtp.model.cache import KVCache
from edgemtp.model.forward import prefill
from edgemtp.quantize.load import load_drafter, load_target
from edgemtp.runtime.generate import generate

WINDOW = 8


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny target (window 8) with a random clustered drafter (drafts mostly rejected)."""
    root = tmp_path_factory.mktemp("pair")
    hf = build_target(root / "t", sliding_window=WINDOW)
    build_assistant(root / "a", hf.config, ordered=True)
    target = load_target(root / "t")
    return hf, target, load_drafter(root / "a", target.cfg)


@pytest.fixture(scope="module")
@torch.no_grad()
def agreeing(tmp_path_factory):
    """A target whose next token is mostly a fixed permutation of the current one, and a drafter
    built to predict that permutation: most drafts are accepted, some are not."""
    root = tmp_path_factory.mktemp("agree")
    torch.manual_seed(3)
    cfg = target_config(sliding_window=WINDOW, tie_word_embeddings=False)
    hf = Gemma4ForCausalLM(cfg).eval()
    embed = hf.model.embed_tokens.weight
    perm = torch.randperm(cfg.vocab_size)
    head = embed[torch.argsort(perm)].clone()  # row perm[t] is e_t: argmax of norm(e_t) is perm[t]
    hf.lm_head.weight.copy_(head)
    for layer in hf.model.layers:  # weak layers: the embedding dominates, context still matters
        for norm in (
            layer.post_attention_layernorm,
            layer.post_feedforward_layernorm,
            layer.post_per_layer_input_norm,
        ):
            norm.weight.fill_(0.2)
    hf.save_pretrained(root / "t")

    asst = Gemma4AssistantForCausalLM(
        build_assistant(root / "unused", cfg, ordered=False, hidden_size=cfg.hidden_size).config
    ).eval()
    h = cfg.hidden_size
    asst.pre_projection.weight.copy_(torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1))
    for layer in asst.model.layers:
        layer.post_attention_layernorm.weight.zero_()
        layer.post_feedforward_layernorm.weight.zero_()
    asst.model.embed_tokens.weight.copy_(head)
    asst.save_pretrained(root / "a")
    target = load_target(root / "t")
    return target, load_drafter(root / "a", target.cfg)


def test_greedy_matches_transformers_generate(pair):
    hf, target, _ = pair
    prompt = torch.randint(3, 128, (21,), generator=torch.Generator().manual_seed(1))
    ref = hf.generate(prompt[None], max_new_tokens=70, do_sample=False, min_new_tokens=70)
    ours = generate(target, prompt.tolist(), 70, stop_ids=(), prefill_chunk=8)
    assert ours.tokens == ref[0, 21:].tolist()
    assert len(ours.tokens) == 70


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_mtp_greedy_equals_ar_random_drafter(pair, depth):
    _, target, drafter = pair
    prompt = torch.randint(
        3, 128, (3 * WINDOW + 5,), generator=torch.Generator().manual_seed(depth)
    ).tolist()
    ar = generate(target, prompt, 4 * WINDOW, prefill_chunk=WINDOW)
    mtp = generate(
        target, prompt, 4 * WINDOW, drafter=drafter, mtp_depth=depth, prefill_chunk=WINDOW
    )
    assert mtp.tokens == ar.tokens
    m = mtp.metrics()
    assert m["drafted"] > 0 and m["generated_tokens"] == 4 * WINDOW
    assert m["acceptance_rate"] < 0.3  # a random drafter: rejections all the way


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_mtp_greedy_equals_ar_agreeing_drafter(agreeing, depth):
    target, drafter = agreeing
    prompt = torch.randint(
        3, 128, (2 * WINDOW + 3,), generator=torch.Generator().manual_seed(depth)
    ).tolist()
    ar = generate(target, prompt, 5 * WINDOW)
    mtp = generate(target, prompt, 5 * WINDOW, drafter=drafter, mtp_depth=depth)
    assert mtp.tokens == ar.tokens
    m = mtp.metrics()
    # both paths of verification are exercised: many accepts and some rejections
    assert 0.3 < m["acceptance_rate"] < 1.0
    assert m["decode_forwards"] < ar.metrics()["decode_forwards"]


def test_budget_counts_committed_tokens_only(agreeing):
    target, drafter = agreeing
    for budget in (1, 2, 5, 9):
        g = generate(target, [5, 6, 7], budget, drafter=drafter, mtp_depth=4)
        assert len(g.tokens) == budget
        assert all(s.drafted <= budget - 1 for s in g.steps)


def test_stop_token_ends_generation(pair):
    _, target, _ = pair
    free = generate(target, [9, 8, 7], 30)
    stop = free.tokens[5]
    g = generate(target, [9, 8, 7], 30, stop_ids=(stop,))
    assert g.tokens == free.tokens[: free.tokens.index(stop) + 1]
    assert g.stop_reason == "stop"


@pytest.mark.parametrize("chunk", [1, 3, 5, 8, 16, 100])
def test_pruned_prefill_same_logits_and_caches(pair, chunk):
    _, target, _ = pair
    ids = torch.randint(0, 128, (37,), generator=torch.Generator().manual_seed(chunk))
    caches, results = [], []
    for prune in (True, False):
        cache = KVCache(target.cfg, 64, max_draft=2)
        results.append(prefill(target, cache, ids, chunk=chunk, prune=prune))
        caches.append(cache)
    (h_p, l_p), (h_u, l_u) = results
    assert torch.allclose(l_p, l_u, atol=1e-5, rtol=0)
    assert torch.allclose(h_p, h_u, atol=1e-5, rtol=0)
    for layer in caches[0].k:
        assert torch.equal(caches[0].k[layer], caches[1].k[layer])
        assert torch.equal(caches[0].v[layer], caches[1].v[layer])
    for kind in caches[0].slot_positions:
        assert torch.equal(caches[0].slot_positions[kind], caches[1].slot_positions[kind])


def test_pruned_prefill_skips_shared_layers(pair):
    _, target, _ = pair
    rows: dict[int, list[int]] = {}
    last = target.cfg.last_owning_layer
    modules = [*target.model.layers, target.model.layers[last].self_attn.k_proj]
    handles = [
        module.register_forward_pre_hook(
            lambda _m, args, i=i: rows.setdefault(i, []).append(args[0].shape[0])
        )
        for i, module in enumerate(modules)
    ]
    try:
        prefill(target, KVCache(target.cfg, 64), torch.arange(20), chunk=8, prune=True)
    finally:
        for handle in handles:
            handle.remove()
    first, n = target.cfg.first_shared_layer, target.cfg.num_layers
    assert all(rows[i] == [8, 8, 4] for i in range(last))
    # the last owning layer: its K/V for every chunk's rows, the layer itself only in the last
    # chunk (no later layer reads its output before), which returns that chunk's last row
    assert rows[n] == [8, 8, 4] and rows[last] == [4]
    assert all(rows[i] == [1] for i in range(first, n))
