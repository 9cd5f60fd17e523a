"""The device runtime: sessions over bundles and checkpoints, chat reuse and truncation, bytes
moved per step, memory-mapped tables, adaptive MTP, and `edgemtp generate --bundle`.

Oracles: the reference engine's greedy tokens (the ONNX CPU program computes the reference's
numerics: fp32 activations on the same 4-bit weights), a fresh session for every reused one,
the config's shapes for bytes, /proc for resident memory, and arithmetic for the depth model.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest
import torch
from oracle_drafts import OracleDrafts, greedy

from edgemtp import __version__
from edgemtp.cli import main
from edgemtp.errors import EdgeMTPError
from edgemtp.export.bundle import write_tables
from edgemtp.model.tables import TokenTables
from edgemtp.quantize.load import load_drafter, load_target
from edgemtp.quantize.tables import Int8Rows
from edgemtp.runtime.adaptive import MAX_AGE, WARMUP, AdaptiveDepth
from edgemtp.runtime.backends import ReferenceBackend
from edgemtp.runtime.bundle import open_tables, read_manifest
from edgemtp.runtime.generate import Step, generate
from edgemtp.runtime.probes import current_rss_mb
from edgemtp.runtime.session import Session

CHUNK = 16
DEPTH = 4
CONTEXT = 4200  # room for the 4096-token context of the bytes-per-step check
N_NEW = 60  # tiny's sliding window is 16: decoding runs far past it


@pytest.fixture(scope="module")
def pair(tiny_q4_0_pair) -> tuple[Path, Path]:
    return tiny_q4_0_pair


@pytest.fixture(scope="module")
def onnx_bundle(pair, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("onnx") / "bundle"
    target, drafter = pair
    assert main(
        [
            "export", "--model", str(target), "--drafter", str(drafter), "--backend", "onnx",
            "--activations", "fp32",  # the reference's numerics: its tokens are the oracle
            "--max-context", str(CONTEXT), "--draft-depth", str(DEPTH),
            "--prefill-chunk", str(CHUNK), "--out", str(out),
        ]
    ) == 0  # fmt: skip
    return out


@pytest.fixture(scope="module")
def reference(pair):
    target = load_target(pair[0])
    return target, load_drafter(pair[1], target.cfg)


def _prompt(n: int = 21, seed: int = 0) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _onnx(bundle: Path) -> Session:
    return Session.from_bundle(bundle, verify=False)


# --- tokens ------------------------------------------------------------------------------------


def test_onnx_session_equals_the_reference_ar_and_mtp_1_to_4(onnx_bundle, reference):
    target, drafter = reference
    session = _onnx(onnx_bundle)
    assert session.info["backend"] == "onnx" and session.backend.max_draft == DEPTH
    ar = generate(target, _prompt(), N_NEW, prefill_chunk=CHUNK).tokens
    for depth in range(DEPTH + 1):
        ref = generate(
            target, _prompt(), N_NEW, drafter=drafter, mtp_depth=depth, prefill_chunk=CHUNK
        )
        session.reset()
        got = session.generate(_prompt(), N_NEW, mtp=depth, stop_ids=())
        assert got.tokens == ref.tokens == ar, depth
        assert got.drafted == ref.drafted and got.accepted == ref.accepted
    session.reset()
    auto = session.generate(_prompt(), N_NEW, stop_ids=())
    assert auto.tokens == ar
    assert sum(s.drafted for s in auto.steps) > 0  # auto tried drafting


def test_partial_acceptance_through_the_session_engine(onnx_bundle, reference):
    """Drafts that every third position disagree: rounds accept none or some of 4 drafts and
    roll the rest back, past the window."""
    target, _ = reference
    ar = generate(target, _prompt(), N_NEW, prefill_chunk=CHUNK).tokens
    session = _onnx(onnx_bundle)
    oracle = OracleDrafts(
        session.backend.runner,
        session.backend.tables,
        target.cfg,
        ar_tokens=ar,
        prompt_len=21,
    )
    got = greedy(oracle, _prompt(), N_NEW, DEPTH)
    assert got.tokens == ar
    assert {s.accepted for s in got.steps if s.kind == "decode"} >= {0, 2}


# --- chat: cache reuse and truncation ------------------------------------------------------------


def _sessions(onnx_bundle, pair):
    return {
        "onnx": lambda: _onnx(onnx_bundle),
        "reference": lambda: Session.from_checkpoints(
            pair[0], pair[1], max_context=CONTEXT, max_draft=DEPTH, prefill_chunk=CHUNK
        ),
    }


@pytest.mark.parametrize("kind", ["onnx", "reference"])
def test_chat_turns_prefill_only_the_new_tokens(onnx_bundle, pair, kind):
    make = _sessions(onnx_bundle, pair)[kind]
    session = make()
    first = session.generate(_prompt(), 20, mtp=2, stop_ids=())
    history = _prompt() + first.tokens
    second_prompt = history + [5, 6, 7]
    second = session.generate(second_prompt, 20, mtp=2, stop_ids=())
    assert second.reused == len(history) - 1  # the last generated token was not in the cache
    assert second.steps[0].kind == "prefill" and second.steps[0].rows == 4
    fresh = make().generate(second_prompt, 20, mtp=2, stop_ids=())
    assert second.tokens == fresh.tokens and fresh.reused == 0


@pytest.mark.parametrize("kind", ["onnx", "reference"])
def test_truncation_inside_and_past_the_sliding_ring(onnx_bundle, pair, kind):
    """tiny: window 16, ring 16 + 4 + 1 = 21 slots. Rolling back a few tokens keeps the cache;
    rolling back past what the ring still holds prefills again. Both equal a fresh session."""
    make = _sessions(onnx_bundle, pair)[kind]
    session = make()
    first = session.generate(_prompt(), 30, mtp=2, stop_ids=())
    history = _prompt() + first.tokens  # 51 tokens, 50 in the cache
    near = history[:47] + [9, 8, 7]  # diverges 3 tokens back: oldest needed 30, 30 + 21 >= 51
    got = session.generate(near, 12, mtp=3, stop_ids=())
    assert got.reused == 47
    assert got.tokens == make().generate(near, 12, mtp=3, stop_ids=()).tokens
    far = history[:10] + [9, 8, 7]  # the ring has overwritten positions 0..9 since
    got = session.generate(far, 12, mtp=3, stop_ids=())
    assert got.reused == 0
    assert got.tokens == make().generate(far, 12, mtp=3, stop_ids=()).tokens
    held = list(session.cached)
    session.truncate(len(held) - 1)  # one token back: always inside the ring
    assert session.cached == held[:-1]
    session.truncate(5)  # 24 positions were written since: the ring lost 0..4
    assert session.cached == []
    assert session.generate(far, 12, mtp=0, stop_ids=()).tokens == got.tokens


def test_session_rejects_what_it_cannot_do(onnx_bundle):
    session = _onnx(onnx_bundle)
    with pytest.raises(EdgeMTPError, match="verifies at most 4 drafts"):
        session.generate(_prompt(), 4, mtp=5)
    with pytest.raises(EdgeMTPError, match="outside the vocabulary"):
        session.generate([1, 2, 512], 4)
    with pytest.raises(EdgeMTPError, match=f"context holds {CONTEXT}"):
        session.generate([3] * CONTEXT, 4)
    # a session stays usable after an error
    assert len(session.generate(_prompt(), 4, stop_ids=()).tokens) == 4


def _interrupt_after(n: int, times: int = 1):
    """An `on_tokens` that sends this process SIGINT `times` times once `n` tokens arrived."""
    seen = []

    def on_tokens(new: list[int]) -> None:
        seen.extend(new)
        if len(seen) >= n and len(seen) - len(new) < n:
            for _ in range(times):
                os.kill(os.getpid(), signal.SIGINT)

    return on_tokens


def test_ctrl_c_keeps_the_tokens_so_far_and_the_session_continues(onnx_bundle, reference):
    target, _ = reference
    ar = generate(target, _prompt(), N_NEW, prefill_chunk=CHUNK).tokens
    session = _onnx(onnx_bundle)
    got = session.generate(_prompt(), N_NEW, mtp=2, stop_ids=(), on_tokens=_interrupt_after(9))
    assert got.stop_reason == "interrupted" and 9 <= len(got.tokens) < N_NEW
    assert got.tokens == ar[: len(got.tokens)]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    rest = session.generate(_prompt() + got.tokens, N_NEW - len(got.tokens), mtp=2, stop_ids=())
    assert rest.reused == 21 + len(got.tokens) - 1  # only the last token was prefilled
    assert got.tokens + rest.tokens == ar
    with pytest.raises(KeyboardInterrupt):  # a second Ctrl-C does not wait for the round
        session.generate(_prompt(), N_NEW, stop_ids=(), on_tokens=_interrupt_after(5, times=2))
    assert session.cached == []
    with pytest.raises(RuntimeError):  # any error: the next call starts afresh
        session.generate(_prompt(), N_NEW, stop_ids=(), on_tokens=_raise_after_tokens)
    assert session.generate(_prompt(), N_NEW, mtp=3, stop_ids=()).tokens == ar


def _raise_after_tokens(new: list[int]) -> None:
    raise RuntimeError("the caller's stream broke")


# --- bytes moved per step ------------------------------------------------------------------------


def _kv_row_bytes(cfg) -> int:
    return sum(2 * s.num_kv_heads * s.head_dim * 4 for s in cfg.layers if s.owns_kv)


@pytest.mark.parametrize("kind", ["onnx", "reference"])
def test_bytes_moved_per_step_do_not_grow_with_context(onnx_bundle, pair, kind):
    make = _sessions(onnx_bundle, pair)[kind]
    cfg = load_target(pair[0]).cfg
    assistant = load_drafter(pair[1], cfg).cfg
    per_step = {}
    for context in (256, 1024, 4096):
        session = make()
        result = session.generate(_prompt(context, seed=context), 12, mtp=2, stop_ids=())
        rounds = [s for s in result.steps if s.kind == "decode" and s.rows == 3]
        assert len(rounds) >= 3  # (the last rounds draft less: the budget ends)
        per_step[context] = {s.bytes_moved for s in rounds}
    assert per_step[256] == per_step[1024] == per_step[4096]
    (moved,) = per_step[4096]
    rows = 3
    if kind == "reference":  # the K/V rows of the verified tokens, nothing else
        assert moved == rows * _kv_row_bytes(cfg)
    else:  # I/O of verify_4 (5 rows, padded) + the new K/V rows + the slot-position vectors
        padded = DEPTH + 1
        ple = cfg.num_layers * cfg.hidden_size_per_layer_input
        io = padded * 4 * (cfg.hidden_size + ple + cfg.vocab_size + cfg.hidden_size) + padded * 8
        ring = cfg.sliding_window + DEPTH + 1
        positions = 8 * ((ring + 1) + (CONTEXT + 1))
        # two draft steps: embedding, hidden, position in; hidden, candidate ids and logits out
        candidates = assistant.centroid_top_k * cfg.vocab_size // assistant.num_centroids
        drafts = 2 * (3 * 4 * cfg.hidden_size + 8 + 12 * candidates)
        assert moved == io + padded * _kv_row_bytes(cfg) + positions + drafts
    cache_bytes = 4 * sum(
        2 * s.num_kv_heads * s.head_dim * (CONTEXT if s.attention == "full" else 21)
        for s in cfg.layers
        if s.owns_kv
    )
    assert moved < cache_bytes / 4  # far from copying the cache


# --- host tables -------------------------------------------------------------------------------


def test_table_rows_are_read_only_when_looked_up(tmp_path):
    """A 96 MiB int8 table, cold (as after a reboot: its pages are evicted from the page cache
    first): looking up 64 rows leaves resident memory near where it was; reading every row
    brings the file in (so the measurement can see it)."""
    import os

    rows, cols = 24_576, 4096
    values = torch.randint(-127, 128, (rows, cols), dtype=torch.int8)
    scales = torch.rand(rows, dtype=torch.float16)
    tables = TokenTables(torch.zeros(8, 16), Int8Rows(values, scales), 1, cols)
    description = write_tables(tables, tmp_path, lambda _: None)
    del values, scales, tables
    fd = os.open(tmp_path / description["file"], os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    cfg = type("Cfg", (), {"num_layers": 1, "hidden_size_per_layer_input": cols})()
    opened = open_tables(tmp_path, cfg, description)  # type: ignore[arg-type]
    table_mb = (tmp_path / description["file"]).stat().st_size / 2**20
    before = current_rss_mb()
    ids = torch.randint(0, rows, (64,), generator=torch.Generator().manual_seed(0))
    looked_up = opened.per_layer_inputs(ids)
    touched = current_rss_mb() - before
    assert looked_up.shape == (64, 1, cols)
    assert touched < 0.1 * table_mb, (touched, table_mb)
    for start in range(0, rows, 2048):
        opened.per_layer_inputs(torch.arange(start, start + 2048))
    assert current_rss_mb() - before > 0.5 * table_mb


def test_static_backend_refills_its_own_inputs_at_every_call():
    """A static method's inputs are the backend's tensors for that row count, refilled at each
    call: a call with fewer real rows than the last one of its size gets zero pad rows at the
    trash position, never the last call's rows (token-id tables: a row is its id)."""
    from edgemtp.model.static import StaticShapes
    from edgemtp.runtime.backends import StaticBackend
    from edgemtp.runtime.conformance import ReplayConfig, TokenIdTables

    calls: list[tuple[str, list[float], list[int]]] = []

    class Recording:
        shapes = StaticShapes(max_context=64, max_draft=2, chunk=4, verify_depths=(0, 2))
        methods = {"prefill_intermediate", "prefill_final", "verify_0", "verify_2", "draft_step"}

        def call(self, method: str, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
            embeds, positions = inputs[0], inputs[-1]
            calls.append((method, embeds.reshape(-1).tolist(), positions.tolist()))
            if method == "draft_step":
                return torch.zeros(1), torch.zeros(1, dtype=torch.long), torch.zeros(8)
            if method.startswith("prefill"):
                return torch.zeros(1), torch.zeros(8)
            return torch.zeros(len(positions), 8), torch.zeros(len(positions), 1)

    cfg = ReplayConfig(vocab_size=8, sliding_window=16, layer_types=("sliding", "full"))
    backend = StaticBackend(Recording(), TokenIdTables(), cfg)  # type: ignore[arg-type]
    backend.prefill([5, 6, 7, 8, 9, 10], 0)
    backend.verify([11, 12, 13], 6)
    logits, hidden = backend.verify([14, 15], 9)
    backend.verify([16], 11)
    backend.draft_step(17, hidden[0], 12)
    assert logits.shape == (2, 8)
    assert calls == [
        ("prefill_intermediate", [5, 6, 7, 8], [0, 1, 2, 3]),
        ("prefill_final", [0, 0, 9, 10], [6, 6, 4, 5]),
        ("verify_2", [11, 12, 13], [6, 7, 8]),
        ("verify_2", [0, 14, 15], [11, 9, 10]),
        ("verify_0", [16], [11]),
        ("draft_step", [17], [12]),
    ]


# --- adaptive MTP ------------------------------------------------------------------------------


def _step(k: int, accepted: int, drafter_s: float, verify_s: float) -> Step:
    step = Step("decode", 0, k + 1, drafted=k, accepted=accepted, committed=accepted + 1)
    step.seconds = {"drafter": k * drafter_s, "total": k * drafter_s + verify_s}
    return step


def test_adaptive_depth_maximises_expected_tokens_per_second():
    """Verify 10 ms at any depth (a static bundle), drafts 1 ms each. The policy's choice must
    be the argmax of E_k / T_k computed here by hand from the acceptance it was shown."""
    for rate, expected in ((1.0, 4), (0.0, 0)):
        policy = AdaptiveDepth(4, lambda k: "verify_0" if k == 0 else "verify_4")
        for _ in range(200):
            k = policy.choose(4)
            accepted = k if rate == 1.0 else 0
            policy.observe(_step(k, accepted, 0.001, 0.010))
        assert policy.choose(4) == expected
    # a middle case: acceptance 0.6 at every position, verify cost growing with rows
    policy = AdaptiveDepth(4, lambda k: f"rows_{k + 1}", decay=1.0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3000):
        k = policy.choose(4)
        accepted = 0
        while accepted < k and torch.rand(1, generator=gen).item() < 0.6:
            accepted += 1
        policy.observe(_step(k, accepted, 0.002, 0.010 + 0.002 * k))
    by_hand = {
        k: sum(0.6**j for j in range(k + 1)) / (k * 0.002 + 0.010 + 0.002 * k) for k in range(5)
    }
    best = max(by_hand, key=by_hand.get)
    assert policy.choose(4) == best  # k = 2: 1.96 tokens / 18 ms
    assert abs(policy.acceptance(1) - 0.6) < 0.05


def test_adaptive_acceptance_prior_of_a_deeper_draft_is_the_one_before_it():
    """Counted by hand: 0.5 of one trial for draft 1; for draft i > 1, draft i - 1's estimate
    of one trial, so an unmeasured deeper draft is never assumed worse than the one before."""
    policy = AdaptiveDepth(3, lambda k: f"rows_{k + 1}", decay=1.0)
    policy.observe(_step(2, 1, 0.002, 0.012))  # draft 1 accepted, draft 2 checked and rejected
    assert policy.acceptance(1) == (1 + 0.5) / (1 + 1)
    assert policy.acceptance(2) == (0 + 0.75) / (1 + 1)
    assert policy.acceptance(3) == 0.375  # never checked: draft 2's estimate
    # The demo pair's costs on this host (verify_3 1.65 AR steps, a draft 0.375) after a warm-up
    # whose two first drafts were accepted (a_1 about 5/6): depth 3 expects about 3.1 tokens in
    # 27.75 ms, AR 1 in 10. With a flat 0.5 prior for drafts 2 and 3 it expected 2.46: AR won,
    # and the deeper drafts were never measured.
    policy = AdaptiveDepth(3, lambda k: "verify_0" if k == 0 else "verify_3")
    for k in (1, 0, 1, 0):
        assert policy.choose(3) == k
        policy.observe(_step(k, k, 0.00375, 0.0165 if k else 0.010))
    assert policy.choose(3) == 3


def test_adaptive_costs_expire_so_a_shape_left_alone_is_measured_again():
    """A drafter that never agrees, AR and depth 1 both 10 ms to verify, a draft 2 ms: AR is
    the choice. But the warm-up's AR rounds ran in a slow second (30 ms). With costs of any
    age AR stayed dearer than drafting forever, since only AR rounds could correct it; a cost
    expires after MAX_AGE rounds, and then AR borrows depth 1's fresh cost, wins, and is
    measured again."""
    policy = AdaptiveDepth(1, lambda k: f"rows_{k + 1}", decay=1.0)
    chosen = []
    for round_ in range(200):
        k = policy.choose(1)
        chosen.append(k)
        slow = round_ < len(WARMUP) and k == 0
        policy.observe(_step(k, 0, 0.002, 0.030 if slow else 0.010))
    assert chosen[: len(WARMUP)] == list(WARMUP)
    first_ar = chosen.index(0, len(WARMUP))
    assert first_ar <= len(WARMUP) + MAX_AGE, chosen
    assert chosen[first_ar:].count(1) <= 0.05 * len(chosen[first_ar:]), chosen
    assert policy.verify_cost(0) == 0.010


def test_auto_with_a_drafter_that_never_agrees_settles_on_ar(pair):
    """The tiny random drafter agrees with the random target ~1/512 of the time: auto mode
    must produce the AR tokens and spend almost no time drafting.

    It still probes now and then (the decayed acceptance estimate drifts back toward the
    prior): a few % of rounds. Before
    the warm-up measured AR twice, an AR cost measured only on its first (set-up) call could
    make depth 1 look faster for good: 196 of 197 rounds drafted, 16 % of the time."""
    target = load_target(pair[0])
    drafter = load_drafter(pair[1], target.cfg)
    session = Session(ReferenceBackend(target, drafter, max_context=512, max_draft=DEPTH))
    result = session.generate(_prompt(), 200, stop_ids=())
    assert result.tokens == generate(target, _prompt(), 200).tokens
    rounds = [s for s in result.steps if s.kind == "decode"]
    assert [s.drafted for s in rounds[:4]] == [1, 0, 1, 0]  # the measuring warm-up
    assert sum(1 for s in rounds[4:] if s.drafted) <= 0.2 * len(rounds[4:])
    assert result.accepted <= 1  # the probes it still makes are (all but) rejected


def test_auto_with_a_drafter_that_always_agrees_goes_deep(onnx_bundle, reference):
    target, _ = reference
    ar = generate(target, _prompt(), N_NEW, prefill_chunk=CHUNK).tokens
    session = _onnx(onnx_bundle)
    oracle = OracleDrafts(
        session.backend.runner, session.backend.tables, target.cfg, ar_tokens=ar, prompt_len=21
    )
    oracle.corrupt = False
    got = Session(oracle).generate(_prompt(), N_NEW, stop_ids=())
    assert got.tokens == ar
    depths = [s.drafted for s in got.steps if s.kind == "decode"][4:]
    assert depths.count(DEPTH) >= 0.7 * len(depths), depths


# --- the command line --------------------------------------------------------------------------


def test_generate_from_a_bundle_on_the_command_line(onnx_bundle, reference, capsys):
    target, _ = reference
    code = main(
        [
            "generate", "--bundle", str(onnx_bundle), "--prompt-ids",
            ",".join(map(str, _prompt())), "--max-new-tokens", "24", "--ignore-eos", "--json",
        ]
    )  # fmt: skip
    assert code == 0
    payload = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert payload["tokens"] == generate(target, _prompt(), 24, prefill_chunk=CHUNK).tokens
    metrics = payload["metrics"]
    assert metrics["mtp"] == "auto"
    assert sum(metrics["mtp_depths_used"].values()) == metrics["decode_forwards"] > 0
    for key in ("bytes_moved_per_step", "peak_rss_mb", "itl_p50_ms", "itl_p95_ms"):
        assert metrics[key] > 0, key
    assert metrics["itl_p50_ms"] <= metrics["itl_p95_ms"]
    energy = metrics["energy"]
    assert set(energy) >= {"source", "energy_j", "j_per_token", "battery_pct_per_1k_tokens"}
    if energy["energy_j"] is None:
        assert energy["reason"].startswith("unavailable: ")
    phases = metrics["decode_seconds_by_phase"]
    assert set(phases) == {"embed", "target", "drafter", "sampling", "host"}
    assert payload["session"]["backend"] == "onnx"
    assert payload["session"]["exported_by"] == f"edgemtp {__version__} (schema 1)"
    assert all("bytes_moved" in s and "total" in s["seconds"] for s in payload["trace"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--delegate", "htp"], "exported for --delegate cpu; its program cannot run on htp"),
        (["--mtp", "7"], "verifies at most 4 drafts"),
        (["--drafter", "x"], "--drafter is for --model"),
        (["--no-prune"], "--no-prune is for --model"),
    ],
)
def test_generate_bundle_errors_are_one_line(onnx_bundle, capsys, args, message):
    code = main(
        ["generate", "--bundle", str(onnx_bundle), "--prompt-ids", "2,3", "--max-new-tokens", "2"]
        + args
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and message in err[-1] and err[-1].startswith("edgemtp generate: error:")


def test_generate_refuses_a_corrupt_bundle(onnx_bundle, tmp_path, capsys):
    import shutil

    copy = shutil.copytree(onnx_bundle, tmp_path / "b")
    manifest = read_manifest(copy)
    with (copy / manifest["tables"]["file"]).open("r+b") as f:
        f.seek(-1, 2)
        f.write(b"\x00" if f.read(1) != b"\x00" else b"\x01")
    code = main(["generate", "--bundle", str(copy), "--prompt-ids", "2,3", "--max-new-tokens", "2"])
    assert code == 1
    assert "does not match its SHA-256" in capsys.readouterr().err


def test_a_bundle_this_host_cannot_run_is_refused_before_loading(onnx_bundle, tmp_path, capsys):
    """A Core ML bundle on Linux: the manifest is read, the host asked, one line naming the
    missing OS (the manifest is not in its own hash table, so only the backend changes)."""
    import shutil

    copy = shutil.copytree(onnx_bundle, tmp_path / "b")
    manifest = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").write_text(json.dumps(dict(manifest, backend="coreml")))
    code = main(["generate", "--bundle", str(copy), "--prompt-ids", "2,3", "--max-new-tokens", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    if sys.platform != "darwin":
        assert "needs macOS 15+" in err[-1] and err[-1].startswith("edgemtp generate: error:")
