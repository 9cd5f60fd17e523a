"""`edgemtp distill`: the packed drafter forward equals the engine's per-position one, a distilled
drafter is accepted far more often than an untrained one (and MTP stays token-identical to AR),
checkpoints resume, and bad inputs fail in one line."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from edgemtp.errors import EdgeMTPError
from edgemtp.model.cache import KVCache
from edgemtp.model.checkpoint import Target
from edgemtp.model.forward import forward_rows
from edgemtp.model.synth import write_preset
from edgemtp.quantize.load import load_drafter, load_target
from edgemtp.runtime.generate import generate
from edgemtp.train import distill as D

CYCLE = 24


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_preset("tiny", tmp_path_factory.mktemp("tiny") / "t", init_std=0.05)


def _fit_to_cycle(target: Target, cycle: torch.Tensor, steps: int = 40) -> None:
    """Teach a random target to continue `cycle` (a random target's greedy text is chaotic, so no
    small drafter could imitate it in seconds). Tables and the tied head stay frozen."""
    seq = cycle.repeat(3)
    ids, labels = seq[:-1], seq[1:]
    embeds, ple = target.tables.embed(ids), target.tables.per_layer_inputs(ids)
    params = [p for n, p in target.model.named_parameters() if n != "lm_head.weight"]
    opt = torch.optim.Adam(params, lr=1e-2)
    with torch.enable_grad():
        for p in params:
            p.requires_grad_(True)
        for _ in range(steps):
            cache = KVCache(target.cfg, ids.numel(), max_draft=ids.numel())
            hidden, _ = target.model(embeds, ple, torch.arange(ids.numel()), cache, "all")
            loss = F.cross_entropy(target.model.logits(hidden), labels)
            opt.zero_grad()
            loss.backward()
            opt.step()


@pytest.fixture(scope="module")
def cyclic(tiny, tmp_path_factory) -> tuple[Path, Path, list[int]]:
    """(target folder, token-id data file, the cycle): a tiny target that continues a cycle."""
    root = tmp_path_factory.mktemp("cyclic")
    target = load_target(tiny)
    cycle = torch.randperm(509, generator=torch.Generator().manual_seed(0))[:CYCLE] + 3
    _fit_to_cycle(target, cycle)
    state = target.model.state_dict()
    tensors = {name: state[k].clone() for k, name in target.names.items() if k != "lm_head.weight"}
    tensors["model.embed_tokens.weight"] = target.tables.tokens.table.float().clone()
    tensors["model.embed_tokens_per_layer.weight"] = target.tables.per_layer.table.float().clone()
    (root / "t").mkdir()
    save_file(tensors, root / "t" / "model.safetensors")
    shutil.copy(tiny / "config.json", root / "t" / "config.json")
    data = root / "ids.txt"
    data.write_text(" ".join(map(str, cycle.repeat(16).tolist())))
    return root / "t", data, cycle.tolist()


def test_packed_drafter_forward_equals_per_position_forward(tiny):
    target = load_target(tiny)
    drafter = D.new_drafter(target, D.assistant_config(target.cfg, layers=3), seed=0)
    assert drafter.masked_embedding is not None
    T, depth = 40, 2  # past the sliding window (16): the ring cache wraps, the mask must too
    g = torch.Generator().manual_seed(1)
    seqs = torch.randint(3, target.cfg.vocab_size, (2, T), generator=g)
    teacher = D.teach(target, seqs, torch.device("cpu"))
    clusters = D.cluster_of(drafter)

    # Packed: every position of both sequences in one forward per step.
    rows = torch.arange(2 * T)
    seq, pos = rows // T, rows % T
    at = torch.nonzero((pos >= 1) & (pos <= T - depth)).squeeze(1)
    masks = D.draft_masks(drafter, pos[at], pos, seq[at], seq)
    hidden, packed = teacher.hidden[at - 1], []
    for j in range(depth):
        embeds = teacher.embeds[at + j]
        hidden, h = D.draft_rows(drafter, embeds, hidden, pos[at], teacher.kv, masks)
        logits = drafter.lm_head(h)
        packed.append((hidden, logits, D.clustered_argmax(drafter, h, logits, clusters)))

    # The engine's way, one position at a time over a ring cache filled as decoding fills it.
    for b in range(2):
        whole = KVCache(target.cfg, T, max_draft=T)
        rows_hidden = forward_rows(target, whole, seqs[b], "all")  # the teacher is this forward
        torch.testing.assert_close(rows_hidden, teacher.hidden[b * T : (b + 1) * T])
        cache = KVCache(target.cfg, T, max_draft=depth)
        for p in range(1, T - depth + 1):
            row = b * T + p
            kv = {i: (k[:, row - 1 : row], v[:, row - 1 : row]) for i, (k, v) in teacher.kv.items()}
            cache.write(kv, p - 1)
            i = int(torch.nonzero(at == row))
            hidden = teacher.hidden[row - 1]
            for j in range(depth):
                hidden, ids, logits = drafter(teacher.embeds[row + j], hidden, p, cache)
                want_hidden, dense, proposed = packed[j]
                torch.testing.assert_close(hidden, want_hidden[i], atol=2e-4, rtol=1e-4)
                torch.testing.assert_close(logits, dense[i, ids], atol=2e-4, rtol=1e-4)
                assert int(ids[logits.argmax()]) == int(proposed[i])


def test_balanced_clusters_are_equal_sized_and_group_similar_rows():
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(8, 16, generator=g)
    rows = centers.repeat_interleave(32, dim=0) + 0.05 * torch.randn(256, 16, generator=g)
    order = D.balanced_clusters(rows, 8)
    assert sorted(order.tolist()) == list(range(256))
    # Each cluster of 32 is exactly one of the planted groups.
    groups = (order // 32).view(8, 32)
    assert all(len(set(g.tolist())) == 1 for g in groups)


def test_distilled_drafter_is_accepted_and_mtp_matches_ar(cyclic, tmp_path):
    target_dir, data, cycle = cyclic
    lines: list[str] = []
    settings = D.Settings(depth=2, seq_len=24, batch=2, lr=3e-3, log_every=20)
    out = tmp_path / "d"
    report = D.distill(target_dir, data, out, 80, "cpu", False, lines.append, settings=settings)
    last = next(line for line in lines if line.startswith("step 80/80"))
    assert "top-1 by depth" in last and "tok/s" in last and "ETA" in last
    assert report["steps"] == 80 and len(report["held_out_top1_by_depth"]) == 2
    assert min(report["held_out_top1_by_depth"]) > 0.8
    assert json.loads((tmp_path / "d" / "distill.json").read_text())["steps"] == 80
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["model_type"] == "gemma4_assistant" and config["use_ordered_embeddings"]

    target = load_target(target_dir)
    distilled = load_drafter(tmp_path / "d", target.cfg)
    untrained = D.new_drafter(target, distilled.cfg.raw, seed=1)
    (tmp_path / "u").mkdir()
    D.save_hf(tmp_path / "u", untrained, 2)
    untrained = load_drafter(tmp_path / "u", target.cfg)

    prompt = cycle[5:15]
    ar = generate(target, prompt, 40)
    assert ar.tokens[:10] == (cycle * 3)[15:25]  # the target does continue the cycle
    good = generate(target, prompt, 40, drafter=distilled, mtp_depth=2)
    bad = generate(target, prompt, 40, drafter=untrained, mtp_depth=2)
    assert good.tokens == ar.tokens == bad.tokens
    good_rate = good.metrics()["mean_committed_per_forward"]
    bad_rate = bad.metrics()["mean_committed_per_forward"]
    assert good_rate > 2.5 and bad_rate < 1.5, (good_rate, bad_rate)


def test_resume_continues_from_the_last_checkpoint(cyclic, tmp_path, capsys):
    target_dir, data, _ = cyclic
    out = tmp_path / "d"
    args = ["--target", str(target_dir), "--data", str(data), "--out", str(out)]
    small = ["--depth", "2", "--seq-len", "12", "--batch", "1", "--save-every", "2"]
    assert D.main([*args, *small, "--steps", "3"]) == 0
    assert torch.load(out / D.CHECKPOINT)["step"] == 3
    assert json.loads((out / "distill.json").read_text())["command"].startswith("edgemtp distill")

    assert D.main([*args, *small, "--steps", "5"]) == 1  # no --resume: refuses to overwrite
    assert "--resume" in capsys.readouterr().err

    lines: list[str] = []
    settings = D.Settings(depth=2, seq_len=12, batch=1, log_every=1)
    report = D.distill(
        target_dir, data, out, 5, resume=True, progress=lines.append, settings=settings
    )
    assert "resuming from step 3" in lines[0]
    assert [line.split()[1] for line in lines if line.startswith("step ")] == ["4/5", "5/5"]
    assert report["steps"] == 5 and report["resumed_from"] == 3
    assert torch.load(out / D.CHECKPOINT)["step"] == 5
    load_drafter(out, load_target(target_dir).cfg)


def test_init_from_an_existing_assistant(tiny, tmp_path):
    data = tmp_path / "ids.txt"
    data.write_text(" ".join(str(3 + i % 7) for i in range(200)))
    init = write_preset("tiny-assistant", tmp_path / "init", dtype="float32")
    settings = D.Settings(depth=2, seq_len=16, batch=1)
    D.distill(tiny, data, tmp_path / "d", 2, progress=lambda _: None, settings=settings, init=init)
    target = load_target(tiny)
    before, after = load_drafter(init, target.cfg), load_drafter(tmp_path / "d", target.cfg)
    assert after.cfg.text.hidden_size == before.cfg.text.hidden_size == 32
    ordering = before.model.masked_embedding.token_ordering
    assert torch.equal(after.model.masked_embedding.token_ordering, ordering)
    assert not torch.equal(after.model.pre_projection.weight, before.model.pre_projection.weight)


def _error(argv: list[str], capsys) -> str:
    assert D.main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("edgemtp distill: error: ")
    return err


def test_bad_inputs_fail_in_one_line(tiny, tmp_path, capsys):
    data = tmp_path / "ids.txt"
    data.write_text(" ".join(["5"] * 100))
    base = ["--data", str(data), "--out", str(tmp_path / "o")]
    out = ["--out", str(tmp_path / "o")]
    cases = {"\n": "no tokens", "hi": "token ids", "5 6 7": "at least", "5 600": "vocabulary"}
    for text, message in cases.items():
        (tmp_path / "bad.txt").write_text(text)
        argv = ["--target", str(tiny), "--data", str(tmp_path / "bad.txt"), *out]
        assert message in _error(argv, capsys)
    assert "no config.json" in _error(["--target", str(tmp_path), *base], capsys)
    assistant = write_preset("tiny-assistant", tmp_path / "a")
    assert "assistant" in _error(["--target", str(assistant), *base], capsys)
    assert "no distill-checkpoint" in _error(["--target", str(tiny), *base, "--resume"], capsys)
    if not torch.cuda.is_available():
        assert "CUDA" in _error(["--target", str(tiny), *base, "--device", "cuda"], capsys)
    assert not (tmp_path / "o").exists()


def test_target_without_kv_sharing_is_refused(tiny):
    cfg = load_target(tiny).cfg
    unshared = dict(cfg.raw, num_kv_shared_layers=0)
    from edgemtp.model.config import parse_text_config

    with pytest.raises(EdgeMTPError, match="no KV-shared layers"):
        D.assistant_config(parse_text_config(unshared))
