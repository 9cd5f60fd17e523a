"""`edgemtp distill`: train an MTP assistant drafter for any Gemma 4 target from the target's own
hidden states, K/V and logits.

Training sees what a draft round sees (`runtime.generate.draft`): at position p, step 1 gets the
target's embedding of the token at p and its hidden state of row p-1; step j > 1 the previous
token's embedding and the drafter's own post-projected hidden state from step j-1, at the same
position, attending to the target's store-layer cache of positions < p; step j predicts the
target's next token at p+j. Tokens are teacher-forced from the data but hidden states are the
drafter's own, so errors compound through the steps as they do when drafting.

Loss, summed over steps: KL(target || drafter) on the full vocabulary (CE against the whole
target distribution: its argmax term is what greedy acceptance needs, the rest what speculative
sampling's needs), plus the centroid scorer's cross-entropy on the cluster of the target's
argmax token. A step's rows are independent (the drafter has no cache), so every position of a
batch goes through one packed forward, the mask keeping each row inside its own sequence.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from edgemtp.errors import EdgeMTPError
from edgemtp.model.checkpoint import Target
from edgemtp.model.config import (
    ASSISTANT_MODEL_TYPE,
    AssistantConfig,
    TextConfig,
    check_drafter_matches,
    parse_assistant_config,
    read_config_json,
)
from edgemtp.model.gemma4 import EmptyCache, Gemma4Drafter
from edgemtp.model.primitives import attends
from edgemtp.model.safetensors_file import TensorEntry, write_tensors
from edgemtp.model.synth import TRANSFORMERS_LAYOUT_VERSION, _text_dict
from edgemtp.quantize.load import load_drafter, load_target

CHECKPOINT = "distill-checkpoint.pt"
REPORT = "distill.json"


@dataclass
class Settings:
    steps: int = 500
    depth: int = 3
    seq_len: int = 128
    batch: int = 8
    lr: float = 1e-3
    layers: int = 2
    hidden: int | None = None  # default min(256, target hidden)
    save_every: int = 100
    log_every: int = 10
    eval_windows: int = 16
    seed: int = 0


# --- the drafter's config, made from the target's ---------------------------------------------


def assistant_config(target: TextConfig, layers: int = 2, hidden: int | None = None) -> dict:
    """An assistant `config.json` for `target`, shaped like Google's (heads of the target's
    store-layer sizes, last layer full attention, clustered head) but small by default."""
    stores = target.store_layers
    if not stores:
        raise EdgeMTPError(
            "the target has no KV-shared layers (num_kv_shared_layers=0); a Gemma 4 assistant "
            "reads the target's store-layer caches, so it cannot draft for this target"
        )
    if layers < 1:
        raise EdgeMTPError(f"--layers must be >= 1, got {layers}")
    # The last layer of a Gemma 4 target is full attention and KV-shared, so a full store exists.
    full = target.layers[stores["full"]]
    sliding = target.layers[stores["sliding"]] if "sliding" in stores else full
    kinds = ["sliding" if "sliding" in stores else "full"] * (layers - 1) + ["full"]
    hidden = hidden or min(256, target.hidden_size)
    vocab = target.vocab_size
    # Google's ratio: clusters of 128 tokens (2048 for 262 144; 64 for our 8192); at least 16
    # clusters for small vocabularies, so the head stays a clustered one.
    centroids = max(1, vocab // min(128, max(1, vocab // 16)))
    while vocab % centroids:
        centroids -= 1
    text = _text_dict(
        hidden=hidden,
        intermediate=4 * hidden,
        layer_types=[f"{k}_attention" for k in kinds],
        num_kv_shared=layers,
        heads=4,
        kv_heads=sliding.num_kv_heads,
        head_dim=sliding.head_dim,
        global_head_dim=full.head_dim,
        ple=0,
        vocab=vocab,
        window=target.sliding_window,
        double_wide=False,
        init_std=0.02,
    )
    for override in text["per_layer_config"].values():
        override["num_key_value_heads"] = full.num_kv_heads
    text["final_logit_softcapping"] = None  # the drafter's head has none (Gemma4Drafter)
    return {
        "architectures": ["Gemma4AssistantForCausalLM"],
        "backbone_hidden_size": target.hidden_size,
        "centroid_intermediate_top_k": min(centroids, max(4, centroids // 64)),
        "dtype": "float32",
        "model_type": "gemma4_assistant",
        "num_centroids": centroids,
        "text_config": text,
        "tie_word_embeddings": True,
        "transformers_version": TRANSFORMERS_LAYOUT_VERSION,
        "use_ordered_embeddings": centroids >= 8,
    }


def balanced_clusters(rows: Tensor, groups: int, iters: int = 8) -> Tensor:
    """Token ordering for a clustered head: `rows` [vocab, dim] (the target's LM head) split into
    `groups` clusters of exactly vocab/groups tokens, cluster c = ordering[c*per:(c+1)*per].

    Recursive balanced bisection: sort a set along a direction and cut it where both sides hold
    whole numbers of clusters; the direction starts as the principal one (power iteration, so it
    is deterministic) and is refined as the difference of the two sides' means (balanced 2-means).
    Equal sizes are what `token_ordering.view(-1, per_centroid)` requires; k-means does not give
    them.
    """
    x = F.normalize(rows.float(), dim=-1)
    per = rows.shape[0] // groups
    done: list[Tensor] = []
    todo = [(torch.arange(rows.shape[0], device=rows.device), groups)]
    while todo:
        ids, n = todo.pop()
        if n == 1:
            done.append(ids)
            continue
        part = x[ids] - x[ids].mean(0)
        direction = torch.ones(x.shape[1], device=x.device)
        for _ in range(iters):
            direction = F.normalize(part.T @ (part @ direction), dim=0)
        cut = n // 2 * per
        for _ in range(iters):
            order = torch.argsort(part @ direction, stable=True)
            direction = part[order[cut:]].mean(0) - part[order[:cut]].mean(0)
        order = ids[torch.argsort(part @ direction, stable=True)]
        todo += [(order[cut:], n - n // 2), (order[:cut], n // 2)]
    return torch.cat(done)


def new_drafter(target: Target, config: dict, seed: int) -> Gemma4Drafter:
    cfg = parse_assistant_config(config, "distilled assistant")
    check_drafter_matches(target.cfg, cfg)
    torch.manual_seed(seed)
    drafter = Gemma4Drafter(cfg, target.cfg)
    if drafter.masked_embedding is not None:
        ordering = balanced_clusters(target.model.lm_head.weight.detach(), cfg.num_centroids)
        drafter.masked_embedding.token_ordering.copy_(ordering)
    return drafter


def cluster_of(drafter: Gemma4Drafter) -> Tensor | None:
    """Token id -> its cluster in the drafter's clustered head (None without one)."""
    head = drafter.masked_embedding
    if head is None:
        return None
    clusters = torch.arange(head.token_ordering.numel(), device=head.token_ordering.device)
    out = torch.empty_like(head.token_ordering)
    out[head.token_ordering] = clusters // head.tokens_per_centroid
    return out


# --- the teacher: the frozen target over whole sequences ---------------------------------------


@dataclass
class Teacher:
    """The target over a batch of sequences, flattened to rows b*T + t."""

    embeds: Tensor  # [B*T, hidden_t] scaled input embeddings
    hidden: Tensor  # [B*T, hidden_t] final-normed hidden states
    logits: Tensor  # [B*T, vocab] soft-capped logits
    kv: dict[int, tuple[Tensor, Tensor]]  # store layer -> K, V [kv_heads, B*T, head_dim]
    seq_len: int


@torch.no_grad()
def teach(target: Target, seqs: Tensor, device: torch.device) -> Teacher:
    """Run the frozen target over each row of `seqs` [B, T] from an empty cache: the same forward
    the reference engine's unpruned prefill makes (every row through every layer)."""
    cfg, model = target.cfg, target.model
    T = seqs.shape[1]
    positions = torch.arange(T, device=device)
    cache = EmptyCache(cfg, device)
    stores = sorted(set(cfg.store_layers.values()))
    embeds, hidden, kv = [], [], {i: ([], []) for i in stores}
    for ids in seqs:
        e = target.tables.embed(ids).to(device)
        ple = target.tables.per_layer_inputs(ids)
        h, new_kv = model(e, ple.to(device) if ple is not None else None, positions, cache, "all")
        embeds.append(e)
        hidden.append(h)
        for i in stores:
            kv[i][0].append(new_kv[i][0])
            kv[i][1].append(new_kv[i][1])
    hidden_all = torch.cat(hidden)
    return Teacher(
        embeds=torch.cat(embeds),
        hidden=hidden_all,
        logits=model.logits(hidden_all),
        kv={i: (torch.cat(k, dim=1), torch.cat(v, dim=1)) for i, (k, v) in kv.items()},
        seq_len=T,
    )


# --- the student: many draft positions in one forward ------------------------------------------


def draft_masks(
    drafter: Gemma4Drafter, q_pos: Tensor, kv_pos: Tensor, q_seq: Tensor, kv_seq: Tensor
) -> dict[str, Tensor]:
    """Per attention kind, [N, S]: each query row sees its own sequence's entries before it."""
    text = drafter.cfg.text
    same = q_seq[:, None] == kv_seq[None, :]
    window = {"sliding": text.sliding_window + 1}  # as `Gemma4Drafter.masks`
    return {
        kind: attends(q_pos - 1, kv_pos, window.get(kind)) & same for kind in set(text.layer_types)
    }


def draft_rows(
    drafter: Gemma4Drafter,
    token_embed: Tensor,
    hidden: Tensor,
    q_pos: Tensor,
    kv: dict[int, tuple[Tensor, Tensor]],
    masks: dict[str, Tensor],
) -> tuple[Tensor, Tensor]:
    """`Gemma4Drafter.step` for N rows at once: token_embed, hidden [N, hidden_t], q_pos [N];
    kv: the target's store-layer K/V the rows may read; masks from `draft_masks`.
    Returns (next hidden [N, hidden_t], final-normed drafter states [N, hidden_d])."""
    segments = {kind: ((kv[i][0],), (kv[i][1],)) for kind, i in drafter.stores.items()}
    return drafter.step(token_embed, hidden, q_pos, segments, masks)


def clustered_argmax(
    drafter: Gemma4Drafter, h: Tensor, logits: Tensor, clusters: Tensor | None
) -> Tensor:
    """The token the drafter proposes under greedy decoding: with a clustered head, the best token
    among the top-k clusters' tokens (what `ClusteredHead` computes), else the plain argmax."""
    head = drafter.masked_embedding
    if head is None or clusters is None:
        return logits.argmax(-1)
    top = torch.topk(head.centroids(h), head.top_k).indices
    keep = torch.zeros(h.shape[0], head.centroids.out_features, dtype=torch.bool, device=h.device)
    keep.scatter_(1, top, True)
    return logits.masked_fill(~keep[:, clusters], float("-inf")).argmax(-1)


@dataclass
class StepResult:
    loss: Tensor
    kl: Tensor  # [depth], detached
    centroid_ce: Tensor  # [depth], empty without a clustered head
    agree: Tensor  # [depth] top-1 agreement with the target (clustered head applied)


def unroll(
    drafter: Gemma4Drafter, teacher: Teacher, depth: int, clusters: Tensor | None
) -> StepResult:
    """All draft positions p in [1, T-depth] of every sequence, `depth` steps each."""
    T = teacher.seq_len
    rows = teacher.hidden.shape[0]
    device = teacher.hidden.device
    seq = torch.arange(rows, device=device) // T
    pos = torch.arange(rows, device=device) % T
    at = torch.nonzero((pos >= 1) & (pos <= T - depth)).squeeze(1)  # flat row of each p
    masks = draft_masks(drafter, pos[at], pos, seq[at], seq)
    hidden = teacher.hidden[at - 1]
    total = torch.zeros((), device=device)
    kl, cce, agree = [], [], []
    for j in range(1, depth + 1):
        row = at + j - 1  # the target's row that predicts token p+j
        hidden, h = draft_rows(drafter, teacher.embeds[row], hidden, pos[at], teacher.kv, masks)
        logits = drafter.lm_head(h)
        target_logp = F.log_softmax(teacher.logits[row].float(), dim=-1)
        log_q = F.log_softmax(logits.float(), dim=-1)
        loss = F.kl_div(log_q, target_logp, reduction="batchmean", log_target=True)
        wanted = teacher.logits[row].argmax(-1)
        kl.append(loss.detach())
        if clusters is not None:
            assert drafter.masked_embedding is not None
            ce = F.cross_entropy(drafter.masked_embedding.centroids(h), clusters[wanted])
            cce.append(ce.detach())
            loss = loss + ce
        total = total + loss
        with torch.no_grad():
            guess = clustered_argmax(drafter, h, logits, clusters)
            agree.append((guess == wanted).float().mean())
    return StepResult(total, _stack(kl), _stack(cce), _stack(agree))


def _stack(values: list[Tensor]) -> Tensor:
    return torch.stack(values) if values else torch.zeros(0)


# --- data ----------------------------------------------------------------------------------------


def load_tokens(data_file: Path, target_dir: Path) -> list[int]:
    from edgemtp.runtime.tokenizer import token_file

    empty = data_file.is_file() and not data_file.read_text(errors="replace").strip()
    ids = [] if empty else token_file(data_file, target_dir, sys.maxsize)
    if not ids:
        raise EdgeMTPError(f"{data_file}: no tokens; pass a text (or token-id) file with content")
    return ids


def split_tokens(ids: list[int], seq_len: int, depth: int) -> tuple[Tensor, Tensor, int]:
    """(training tokens, held-out tokens: the last tenth, sequence length that fits both)."""
    need = 10 * (depth + 2)
    if len(ids) < need:
        raise EdgeMTPError(
            f"the data has {len(ids)} tokens; distilling at depth {depth} needs at least {need} "
            "(a tenth is held out): pass a longer file"
        )
    cut = len(ids) - len(ids) // 10
    train, held = torch.tensor(ids[:cut]), torch.tensor(ids[cut:])
    return train, held, min(seq_len, cut)


def windows(tokens: Tensor, seq_len: int, batch: int, gen: torch.Generator) -> Tensor:
    starts = torch.randint(0, tokens.numel() - seq_len + 1, (batch,), generator=gen)
    return torch.stack([tokens[s : s + seq_len] for s in starts.tolist()])


def held_out_windows(tokens: Tensor, seq_len: int, limit: int) -> Tensor:
    n = tokens.numel()
    T = min(seq_len, n)
    starts = list(range(0, n - T + 1, T))[:limit]
    return torch.stack([tokens[s : s + T] for s in starts])


# --- checkpoints -----------------------------------------------------------------------------


def save_checkpoint(
    path: Path, drafter: Gemma4Drafter, opt: torch.optim.Optimizer, step: int
) -> None:
    state = {
        "step": step,
        "config": drafter.cfg.raw,
        "model": {k: v.detach().cpu() for k, v in drafter.state_dict().items()},
        "optimizer": opt.state_dict(),
    }
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def save_hf(out: Path, drafter: Gemma4Drafter, depth: int) -> None:
    """config.json + model.safetensors in the layout `load_drafter` (and transformers) read."""
    tensors: dict[str, np.ndarray] = {}
    for key, value in drafter.state_dict().items():
        name = "model." + key if key.startswith(("layers.", "norm.")) else key
        if key == "lm_head.weight":  # tied: the assistant's lm_head is its token table
            name = "model.embed_tokens.weight"
        tensors[name] = value.detach().cpu().contiguous().numpy()
    codes = {np.dtype("float32"): "F32", np.dtype("int64"): "I64"}
    entries = [TensorEntry(n, codes[a.dtype], tuple(a.shape)) for n, a in sorted(tensors.items())]
    write_tensors(out, entries, lambda e: [tensors[e.name]])
    (out / "config.json").write_text(json.dumps(drafter.cfg.raw, indent=2, sort_keys=True) + "\n")
    text = drafter.cfg.text
    generation = {
        "bos_token_id": text.bos_token_id,
        "eos_token_id": list(text.eos_token_ids),
        "num_assistant_tokens": depth,
        "pad_token_id": text.pad_token_id,
        "transformers_version": TRANSFORMERS_LAYOUT_VERSION,
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


# --- the loop ----------------------------------------------------------------------------------


def _load_target(path: Path) -> Target:
    if (path / "config.json").is_file() and (
        read_config_json(path).get("model_type") == ASSISTANT_MODEL_TYPE
    ):
        raise EdgeMTPError(
            f"{path} is a Gemma 4 assistant (drafter); --target needs the model it drafts for"
        )
    return load_target(path)


def resolve_device(device: str) -> torch.device:
    if device == "cuda" and not torch.cuda.is_available():
        raise EdgeMTPError(
            "--device cuda: this torch build has no usable CUDA device; use --device cpu"
        )
    if device not in ("cpu", "cuda"):
        raise EdgeMTPError(f"--device {device}: choose cpu or cuda")
    return torch.device(device)


def _lr(step: int, total: int, peak: float) -> float:
    warm = max(1, min(50, total // 10))
    if step < warm:
        return peak * (step + 1) / warm
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm))))


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


@torch.no_grad()
def evaluate(
    drafter: Gemma4Drafter, target: Target, held: Tensor, s: Settings, device: torch.device
) -> list[float]:
    """Top-1 agreement with the target per depth on the held-out windows (greedy acceptance
    proxy: depth j's agreement counts rows, not accepted prefixes)."""
    drafter.eval()
    seqs = held_out_windows(held, s.seq_len, s.eval_windows)
    if seqs.shape[1] < s.depth + 1:
        return []
    result = unroll(drafter, teach(target, seqs, device), s.depth, cluster_of(drafter))
    drafter.train()
    return result.agree.tolist()


def distill(
    target_dir: Path,
    data_file: Path,
    out_dir: Path,
    steps: int = 500,
    device: str = "cpu",
    resume: bool = False,
    progress: Callable[[str], None] = print,
    *,
    settings: Settings | None = None,
    init: Path | None = None,
    command: str | None = None,
) -> dict[str, Any]:
    """Train a drafter for the target at `target_dir` on `data_file`; write it to `out_dir`
    (HF layout + distill.json, checkpoints every `save_every` steps). Returns distill.json."""
    s = settings or Settings()
    s.steps = steps
    if steps < 1 or s.depth < 1 or s.batch < 1 or s.seq_len < 2:
        raise EdgeMTPError("--steps, --depth and --batch must be >= 1, --seq-len >= 2")
    dev = resolve_device(device)
    out_dir = Path(out_dir)
    ckpt_path = out_dir / CHECKPOINT
    if resume and not ckpt_path.is_file():
        raise EdgeMTPError(f"--resume: {out_dir} has no {CHECKPOINT}; run without --resume")
    if not resume and out_dir.is_dir() and any(out_dir.iterdir()):
        raise EdgeMTPError(f"{out_dir} is not empty; choose a new --out or pass --resume")

    target = _load_target(Path(target_dir))
    ids = load_tokens(Path(data_file), Path(target_dir))
    if not 0 <= min(ids) <= max(ids) < target.cfg.vocab_size:
        bad = next(i for i in ids if not 0 <= i < target.cfg.vocab_size)
        raise EdgeMTPError(
            f"{data_file}: token id {bad} is outside the target's vocabulary "
            f"(0..{target.cfg.vocab_size - 1}); the ids must come from this target's tokenizer"
        )
    train, held, s.seq_len = split_tokens(ids, s.seq_len, s.depth)
    if s.seq_len < s.depth + 1:
        raise EdgeMTPError(f"--seq-len {s.seq_len} is too short for --depth {s.depth}")
    target.model.to(dev)

    state = torch.load(ckpt_path, map_location="cpu", weights_only=True) if resume else None
    if state is not None:
        drafter = Gemma4Drafter(parse_assistant_config(state["config"]), target.cfg)
        check_drafter_matches(target.cfg, drafter.cfg)
        drafter.load_state_dict(state["model"])
    elif init is not None:
        drafter = load_drafter(Path(init), target.cfg).model
    else:
        drafter = new_drafter(target, assistant_config(target.cfg, s.layers, s.hidden), s.seed)
    drafter.to(dev).train().requires_grad_(True)
    opt = torch.optim.AdamW(drafter.parameters(), lr=s.lr, weight_decay=0.0)
    start = 0
    if state is not None:
        opt.load_state_dict(state["optimizer"])
        start = state["step"]
        progress(f"resuming from step {start} ({ckpt_path})")
    out_dir.mkdir(parents=True, exist_ok=True)
    clusters = cluster_of(drafter)
    cfg: AssistantConfig = drafter.cfg
    progress(
        f"distill: {len(train)} training / {len(held)} held-out tokens; drafter "
        f"{cfg.text.num_layers} layers, hidden {cfg.text.hidden_size}, "
        f"{sum(p.numel() for p in drafter.parameters()) / 1e6:.2f} M params, "
        f"{'clustered head ' + str(cfg.num_centroids) if cfg.use_ordered_embeddings else 'dense'}"
        f"; depth {s.depth}, batch {s.batch} x {s.seq_len} tokens, {s.steps} steps on {dev}"
    )

    last: StepResult | None = None
    t0, tokens = time.perf_counter(), 0
    with torch.enable_grad():
        for step in range(start, s.steps):
            # Seeded per step, so a resumed run sees the batches the uninterrupted one would.
            gen = torch.Generator().manual_seed(s.seed * 1_000_003 + step)
            teacher = teach(target, windows(train, s.seq_len, s.batch, gen), dev)
            for group in opt.param_groups:
                group["lr"] = _lr(step, s.steps, s.lr)
            last = unroll(drafter, teacher, s.depth, clusters)
            opt.zero_grad(set_to_none=True)
            last.loss.backward()
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
            opt.step()
            tokens += s.batch * s.seq_len
            done = step + 1
            if done % s.log_every == 0 or done == s.steps:
                elapsed = time.perf_counter() - t0
                rate = tokens / elapsed
                eta = (s.steps - done) * s.batch * s.seq_len / rate
                agree = " ".join(f"{a:.2f}" for a in last.agree.tolist())
                progress(
                    f"step {done}/{s.steps}  loss {last.loss.item():.3f}  top-1 by depth {agree}"
                    f"  {rate:,.0f} tok/s  ETA {_clock(eta)}"
                )
            if done % s.save_every == 0 or done == s.steps:
                save_checkpoint(ckpt_path, drafter, opt, done)

    agree = evaluate(drafter, target, held, s, dev)
    drafter.to("cpu").eval().requires_grad_(False)
    save_hf(out_dir, drafter, s.depth)
    report = {
        "command": command,
        "target": str(target_dir),
        "data": str(data_file),
        "steps": s.steps,
        "resumed_from": start if resume else None,
        "device": str(dev),
        "depth": s.depth,
        "seq_len": s.seq_len,
        "batch": s.batch,
        "lr": s.lr,
        "loss": "KL(target || drafter) per depth + centroid CE on the target argmax's cluster",
        "final_loss": last.loss.item() if last else None,
        "final_kl_by_depth": last.kl.tolist() if last else None,
        "final_centroid_ce_by_depth": last.centroid_ce.tolist() if last else None,
        "final_train_top1_by_depth": last.agree.tolist() if last else None,
        "held_out_tokens": len(held),
        "held_out_top1_by_depth": agree,
        "seconds": time.perf_counter() - t0,
    }
    (out_dir / REPORT).write_text(json.dumps(report, indent=2) + "\n")
    progress(f"wrote {out_dir} (held-out top-1 by depth: {' '.join(f'{a:.2f}' for a in agree)})")
    return report


# --- command line ------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = Settings()
    p.add_argument("--target", type=Path, required=True, help="Gemma 4 target checkpoint folder")
    p.add_argument("--data", type=Path, required=True, help="text (or token-id) training file")
    p.add_argument("--out", type=Path, required=True, help="folder for the distilled assistant")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--depth", type=int, default=d.depth, help="draft steps trained (default 3)")
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--layers", type=int, default=d.layers, help="drafter layers (new drafter)")
    p.add_argument("--hidden", type=int, default=None, help="drafter width (default <= 256)")
    p.add_argument("--init", type=Path, default=None, help="start from this assistant checkpoint")
    p.add_argument("--save-every", type=int, default=d.save_every)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--resume", action="store_true", help="continue from --out's last checkpoint")


def run_distill(args: argparse.Namespace, command: str | None = None) -> int:
    settings = Settings(
        depth=args.depth,
        seq_len=args.seq_len,
        batch=args.batch,
        lr=args.lr,
        layers=args.layers,
        hidden=args.hidden,
        save_every=max(1, args.save_every),
        seed=args.seed,
    )

    def progress(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    distill(
        args.target,
        args.data,
        args.out,
        args.steps,
        args.device,
        args.resume,
        progress,
        settings=settings,
        init=args.init,
        command=command,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="edgemtp distill", description=__doc__.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_distill(args, "edgemtp distill " + shlex.join(argv))
    except (EdgeMTPError, OSError) as err:
        print(f"edgemtp distill: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("edgemtp distill: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
