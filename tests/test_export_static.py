"""Static-shape export wrappers: eager equality with the reference engine, pruned prefill graph."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict

import pytest
import torch
from oracle_drafts import OracleDrafts, WholeCacheCheck, greedy
from torch.export import ExportedProgram

from edgemtp.export.executorch_program import export_method
from edgemtp.export.forms import EXPORT, XNNPACK
from edgemtp.export.primitives import BLOCKED, arithmetic_mask
from edgemtp.model.cache import KVCache, StaticCache
from edgemtp.model.forward import prefill
from edgemtp.model.primitives import REFERENCE, attends
from edgemtp.model.static import StaticBundle, StaticShapes, auto_context_buckets
from edgemtp.model.synth import write_preset
from edgemtp.quantize.load import load_drafter, load_target
from edgemtp.runtime.backends import StaticBackend
from edgemtp.runtime.generate import generate
from edgemtp.runtime.runners.eager import EagerRunner

SHAPES = StaticShapes(max_context=96, max_draft=2, chunk=8)
N_NEW = 40  # tiny's window is 16: decoding runs well past it


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("static")
    write_preset("tiny", root / "t", init_std=0.05)
    write_preset("tiny-assistant", root / "a", init_std=0.05)
    return root / "t", root / "a"


def _load(paths):
    target = load_target(paths[0])
    return target, load_drafter(paths[1], target.cfg)


@pytest.fixture(scope="module")
def reference(paths):
    return _load(paths)


@pytest.fixture(params=["reference", "export"])
def static(paths, request):
    """A fresh bundle in the reference form or the export form (its models then belong to it,
    so never shared)."""
    target, drafter = _load(paths)
    form = EXPORT if request.param == "export" else None
    bundle = StaticBundle.build(target.model, drafter.model, SHAPES, *([form] if form else []))
    return bundle, StaticBackend(EagerRunner(bundle), target.tables, target.cfg)


def _prompt(n: int = 21) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(0)).tolist()


@pytest.mark.parametrize("depth", [0, 2])
def test_static_eager_matches_reference_tokens(reference, static, depth):
    target, drafter = reference
    ref = generate(target, _prompt(), N_NEW, drafter=drafter, mtp_depth=depth, prefill_chunk=8)
    got = greedy(static[1], _prompt(), N_NEW, depth)
    assert got.tokens == ref.tokens
    assert got.calls["prefill_intermediate"] == 2 and got.calls["prefill_final"] == 1
    if depth:
        assert got.drafted == ref.metrics()["drafted"]


@pytest.mark.parametrize("form", [None, EXPORT])
def test_draft_chains_draft_what_draft_steps_draft(reference, paths, form):
    """Given the token table, the bundle drafts greedily in one call per round (`draft_K`:
    the picks and the token lookups in the method), to the tokens and acceptance of the
    step-by-step rounds and of the reference."""
    target, drafter = reference
    ref = generate(target, _prompt(), N_NEW, drafter=drafter, mtp_depth=2, prefill_chunk=8)
    fresh, fresh_drafter = _load(paths)
    embedding = fresh.tables.token_rows_in_graph()
    bundle = StaticBundle.build(
        fresh.model, fresh_drafter.model, SHAPES, *([form] if form else []), embedding=embedding
    )
    assert {"draft_1", "draft_2"} <= set(bundle.methods())
    backend = StaticBackend(EagerRunner(bundle), fresh.tables, fresh.cfg)
    chained = greedy(backend, _prompt(), N_NEW, 2)
    assert "draft_step" not in chained.calls and chained.calls["draft_2"] >= 3
    stepped = greedy(StepOnly(backend), _prompt(), N_NEW, 2)
    assert "draft_2" not in stepped.calls
    assert chained.tokens == stepped.tokens == ref.tokens
    assert chained.accepted == stepped.accepted == ref.accepted


class StepOnly:
    """A backend without draft chains: the engine drafts step by step."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def draft_chain(self, token, hidden, position, depth):
        return None


@pytest.mark.parametrize("window", [None, 16])
def test_arithmetic_mask_blocks_exactly_what_the_bool_mask_blocks(window):
    # rows at 30..37 over slots holding past, current, future and empty (-1) positions
    rows = torch.arange(30, 38)
    keys = torch.tensor([-1, 0, 5, 13, 14, 15, 21, 29, 30, 33, 37, 38, 60, -1])
    allowed = attends(rows, keys, window)
    additive = arithmetic_mask(XNNPACK.step, rows, keys, window)
    assert torch.equal(additive == 0, allowed)
    assert (additive[~allowed] <= BLOCKED).all() and additive.isfinite().all()
    # the softmax over masked scores is the -inf form's, exactly
    scores = torch.randn(rows.shape[0], keys.shape[0]) * 30
    ref = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    assert torch.equal(torch.softmax(scores + additive, dim=-1), ref)


def test_drafter_arithmetic_mask_blocks_exactly_what_its_bool_mask_blocks(paths):
    """The assistant reads the entries before its position, its sliding window the window + 1
    newest of them: over past, current, future and empty slots, and slots at the window's edge."""
    drafter = _load(paths)[1].model
    window = drafter.cfg.text.sliding_window
    pos = torch.tensor([40])
    keys = torch.tensor([-1, 0, 40 - window - 2, 40 - window - 1, 40 - window, 20, 38, 39, 40, 41])

    class Keys:  # a cache view holding `keys` for both kinds
        def positions(self, kind: str) -> torch.Tensor:
            return keys

    allowed = drafter.masks(pos, Keys(), REFERENCE)
    additive = drafter.masks(pos, Keys(), XNNPACK.step)
    # the reference drafter mask, written out: before the position, in the window + 1 newest
    inside = (keys >= 0) & (keys < 40) & (39 - keys <= window)
    assert torch.equal(allowed["sliding"][0], inside)
    for kind in allowed:
        assert torch.equal(additive[kind] == 0, allowed[kind]), kind
        assert (additive[kind][~allowed[kind]] <= BLOCKED).all()
    assert allowed["sliding"].sum() < allowed["full"].sum()  # the window did block something


@pytest.mark.parametrize("depth", [0, 2])
def test_arithmetic_masks_decode_the_reference_tokens(reference, paths, depth):
    target, drafter = _load(paths)
    bundle = StaticBundle.build(target.model, drafter.model, SHAPES, XNNPACK)  # float weights
    backend = StaticBackend(EagerRunner(bundle), target.tables, target.cfg)
    ref_target, ref_drafter = reference
    ref = generate(ref_target, _prompt(), N_NEW, drafter=ref_drafter, mtp_depth=depth,
                   prefill_chunk=8)  # fmt: skip
    assert greedy(backend, _prompt(), N_NEW, depth).tokens == ref.tokens


def test_slot_positions_are_what_writing_each_row_in_turn_gives(reference):
    """The cache's slot positions after a sequence of calls (chunks, a left-padded final
    chunk, verifies, rollbacks, wrapping the sliding ring several times) equal a plain loop's:
    truncate every slot at or past the call's first position, then write each row in turn."""
    cfg = reference[0].cfg
    cache = StaticCache(cfg, SHAPES.max_context, SHAPES.max_draft)
    expected = {kind: [-1] * (n + 1) for kind, n in cache.slots.items()}
    calls = [(0, 8, 0), (8, 5, 3), (13, 3, 0), (14, 1, 0), (15, 3, 1), (17, 8, 0), (20, 2, 0)]
    calls += [(22 + 3 * i, 3, i % 3) for i in range(20)]  # past the 16-token window, twice
    for start, rows, pads in calls:
        end = start + rows
        positions = torch.cat([torch.full((pads,), end), torch.arange(start, end)])
        cache.write(cache.view(truncate_at=positions.min()), {}, positions, REFERENCE)
        for kind, n in cache.slots.items():
            slots = expected[kind]
            slots[:] = [-1 if p >= start else p for p in slots]
            for p in range(start, start + rows):
                slots[p % n] = p
            assert cache.pos(kind).tolist() == slots, (kind, start, rows, pads)


@pytest.mark.parametrize("n", [1, 8, 13])
def test_prefill_chunks_and_padding(reference, static, n):
    target, _ = reference
    cache = KVCache(target.cfg, SHAPES.max_context, SHAPES.max_draft)
    ref_hidden, ref_logits = prefill(target, cache, torch.tensor(_prompt(n)), chunk=8)
    hidden, logits = static[1].prefill(_prompt(n), 0)
    torch.testing.assert_close(hidden, ref_hidden, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)


def test_draft_step_matches_reference_drafter(reference, static):
    target, drafter = reference
    prompt = _prompt()
    cache = KVCache(target.cfg, SHAPES.max_context, SHAPES.max_draft)
    hidden, _ = prefill(target, cache, torch.tensor(prompt), chunk=8)
    static_hidden, _ = static[1].prefill(prompt, 0)
    embed = target.tables.embed(torch.tensor([7]))[0]
    position = len(prompt)
    ref = drafter.model(embed, hidden, position, cache)
    got = static[0].drafter.draft_step(embed, static_hidden, torch.tensor([position]))
    torch.testing.assert_close(got[0], ref[0], atol=1e-4, rtol=1e-4)
    assert torch.equal(got[1], ref[1])
    torch.testing.assert_close(got[2], ref[2], atol=1e-4, rtol=1e-4)


def test_partial_acceptance_rollback_past_window(reference, static):
    target, _ = reference
    ar = generate(target, _prompt(), N_NEW).tokens
    bundle, _ = static
    driver = OracleDrafts(
        EagerRunner(bundle), target.tables, target.cfg, ar_tokens=ar, prompt_len=21
    )
    got = greedy(driver, _prompt(), N_NEW, depth=2)
    assert got.tokens == ar
    assert 0 < got.accepted < got.drafted


def test_intermediate_prefill_has_no_shared_layer_ops(static):
    bundle, _ = static
    cfg = bundle.target.target.cfg
    only = ("prefill_intermediate", "prefill_final")
    programs = {name: export_method(m, x) for name, (m, x) in bundle.methods().items()
                if name in only}  # fmt: skip
    inter = ops_per_layer(programs["prefill_intermediate"])
    final = ops_per_layer(programs["prefill_final"])
    owned = range(cfg.first_shared_layer)
    assert sorted(inter) == list(owned)
    last = cfg.last_owning_layer
    assert all(inter[i] == final[i] for i in range(last))
    # no later layer reads the last owning layer's output in an intermediate chunk: its K/V
    # projections alone (in the final chunk the rest runs, on the last row)
    assert inter[last] == (1 if cfg.layers[last].k_eq_v else 2) < final[last]
    assert all(final[i] > 0 for i in range(cfg.first_shared_layer, cfg.num_layers))


def ops_per_layer(program: ExportedProgram, prefix: str = "owner.target.layers.") -> Counter:
    """Linear and matmul nodes per target layer (from each node's module stack)."""
    counts: Counter = Counter()
    for node in program.graph.nodes:
        if node.op != "call_function" or not any(
            op in str(node.target) for op in ("linear", "matmul")
        ):
            continue
        for path, _ in (node.meta.get("nn_module_stack") or {}).values():
            if path.startswith(prefix):
                counts[int(path[len(prefix) :].split(".")[0])] += 1
                break
    return counts


BUCKETED = StaticShapes(max_context=96, max_draft=2, chunk=8, context_buckets=(12, 48))


@pytest.mark.parametrize("oracle", [False, True], ids=["drafter", "rollback"])
def test_context_buckets_decode_like_the_whole_cache(paths, reference, oracle):
    """Bucketed methods read only the first 12 / 48 slots (tiny's sliding ring holds more than
    12), yet every bucketed call, decoding past both buckets with drafts accepted and rolled
    back across their edges, returns what the whole-cache method returns, and the tokens are
    the reference's."""
    ref_target, ref_drafter = reference
    prompt = _prompt(5)
    ar = generate(ref_target, prompt, 70).tokens
    ref = generate(ref_target, prompt, 70, drafter=ref_drafter, mtp_depth=2, prefill_chunk=8)
    target, drafter = _load(paths)
    bundle = StaticBundle.build(target.model, drafter.model, BUCKETED)
    assert min(bundle.cache.slots.values()) > 12
    runner = WholeCacheCheck(EagerRunner(bundle))
    if oracle:
        backend = OracleDrafts(runner, target.tables, target.cfg, ar_tokens=ar, prompt_len=5)
    else:
        backend = StaticBackend(runner, target.tables, target.cfg)
    got = greedy(backend, prompt, 70, depth=2)
    assert got.tokens == (ar if oracle else ref.tokens)
    assert runner.worst < 1e-5
    verify = {m for m in got.calls if m.startswith("verify_")}
    assert {"verify_2_ctx12", "verify_2_ctx48", "verify_2"} <= verify
    if not oracle:
        assert {"draft_step_ctx12", "draft_step_ctx48", "draft_step"} <= set(got.calls)


def test_context_buckets_alone_keep_the_cache(paths, reference):
    """Bucketed methods on their own (no whole-cache call beside them rewriting the slot
    positions): their own bookkeeping keeps the cache right, across both bucket edges."""
    ref_target, ref_drafter = reference
    prompt = _prompt(5)
    ref = generate(ref_target, prompt, 70, drafter=ref_drafter, mtp_depth=2, prefill_chunk=8)
    target, drafter = _load(paths)
    bundle = StaticBundle.build(target.model, drafter.model, BUCKETED)
    got = greedy(StaticBackend(EagerRunner(bundle), target.tables, target.cfg), prompt, 70, 2)
    assert got.tokens == ref.tokens
    assert {"verify_2_ctx12", "verify_2_ctx48", "draft_step_ctx12"} <= set(got.calls)


@pytest.mark.parametrize(
    ("n", "methods"),
    [
        (5, {"prefill_final_ctx12"}),
        (30, {"prefill_intermediate_ctx12", "prefill_intermediate_ctx48", "prefill_final_ctx48"}),
        (60, {"prefill_intermediate_ctx12", "prefill_intermediate_ctx48",
              "prefill_intermediate", "prefill_final"}),
    ],
)  # fmt: skip
def test_context_buckets_prefill_like_the_whole_cache(paths, reference, n, methods):
    """Each prompt chunk runs through the smallest bucket holding its rows (reading 12 or 48
    slots) and leaves a cache from which decoding, past both buckets, gives the reference's
    tokens. (`WholeCacheCheck` cannot run a prefill chunk twice: a chunk that wraps the
    sliding ring overwrites keys that its second run would still read.)"""
    ref_target, _ = reference
    prompt = _prompt(n)
    ref = generate(ref_target, prompt, 30, prefill_chunk=8)
    target, drafter = _load(paths)
    bundle = StaticBundle.build(target.model, drafter.model, BUCKETED)
    got = greedy(StaticBackend(EagerRunner(bundle), target.tables, target.cfg), prompt, 30, 0)
    assert got.tokens == ref.tokens
    assert {m for m in got.calls if m.startswith("prefill")} == methods


def test_context_buckets_must_fit_between_depth_and_context():
    with pytest.raises(ValueError, match="between the draft depth"):
        StaticShapes(96, 2, 8, (2,))
    with pytest.raises(ValueError, match="between the draft depth"):
        StaticShapes(96, 2, 8, (96,))
    shapes = StaticShapes(96, 2, 8, [48, 12, 48])  # as a manifest's JSON gives them
    assert shapes.context_buckets == (12, 48)
    assert shapes.verify_method(1, end=12) == ("verify_2_ctx12", 1)
    every = shapes.every_depth()  # a verify per depth: no round pays for pad rows
    assert every.verify_depths == (0, 1, 2)
    assert every.verify_method(1, end=12) == ("verify_1_ctx12", 0)
    older = StaticShapes.from_manifest({"max_context": 96, "max_draft": 2, "chunk": 8})
    assert older.verify_method(1) == ("verify_2", 1)  # a bundle with verify_0 and verify_2 only
    assert StaticShapes.from_manifest(asdict(every)) == every
    with pytest.raises(ValueError, match="must include 0"):
        StaticShapes(96, 2, 8, verify_depths=(1, 2))
    assert shapes.verify_method(0, end=13) == ("verify_0_ctx48", 0)
    assert shapes.verify_method(2, end=49) == ("verify_2", 0)
    assert shapes.draft_method(48) == "draft_step_ctx48"
    assert shapes.prefill_method(False, 12) == "prefill_intermediate_ctx12"
    assert shapes.prefill_method(True, 49) == "prefill_final"
    assert [auto_context_buckets(n) for n in (1024, 2048, 4096, 32768)] == [
        (),
        (512,),
        (512, 2048),
        (512, 2048, 8192),
    ]
