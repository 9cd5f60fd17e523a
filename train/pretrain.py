"""Pre-train the embedded default target: a ~16 M-parameter Gemma 4 on CPython's stdlib.

The model is edgemtp's own `Gemma4Target` (no second copy of the math): each sequence runs from
position 0 over an empty cache view, batched with `torch.vmap`. The token table (tied with the LM
head) and the per-layer table, host-side `TokenTables` rows at inference, are parameters here and
are written back into the checkpoint.

    python -m edgemtp.train.pretrain --data DIR --out DIR --minutes 33
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edgemtp.errors import EdgeMTPError
from edgemtp.model.config import TextConfig, parameter_count, parse_text_config
from edgemtp.model.gemma4 import EmptyCache, Gemma4Target
from edgemtp.model.safetensors_file import TensorEntry, write_tensors
from edgemtp.model.synth import (
    TRANSFORMERS_LAYOUT_VERSION,
    _generation_config,
    _text_dict,
    tensor_specs,
)
from edgemtp.model.tables import TokenTables
from edgemtp.train import data


def state_path(out: Path) -> Path:
    """Where --resume finds the optimizer state: beside the checkpoint, so the model folder holds
    only what a model folder should."""
    return out.parent / f"{out.name}.train_state.pt"


def embedded_config(
    vocab: int = data.VOCAB_SIZE,
    *,
    hidden: int = 256,
    intermediate: int = 384,
    period: int = 4,
    blocks: int = 2,
    shared_blocks: int = 1,
    heads: int = 4,
    head_dim: int = 64,
    global_head_dim: int = 128,
    ple: int = 128,
    window: int = 128,
    init_std: float = 0.02,
) -> dict[str, Any]:
    """The embedded target's config.json: `blocks` of (period-1) sliding + 1 full layers, the
    last `shared_blocks` of them KV-shared (E2B's pattern, scaled down)."""
    n = period * blocks
    layer_types = [
        "full_attention" if i % period == period - 1 else "sliding_attention" for i in range(n)
    ]
    cfg = _text_dict(
        hidden=hidden,
        intermediate=intermediate,
        layer_types=layer_types,
        num_kv_shared=period * shared_blocks,
        heads=heads,
        kv_heads=1,
        head_dim=head_dim,
        global_head_dim=global_head_dim,
        ple=ple,
        vocab=vocab,
        window=window,
        double_wide=True,
        init_std=init_std,
    )
    cfg["architectures"] = ["Gemma4ForCausalLM"]
    cfg["dtype"] = "float32"
    cfg["transformers_version"] = TRANSFORMERS_LAYOUT_VERSION
    return dict(sorted(cfg.items()))


# --- the model under training ------------------------------------------------------------------


class TrainModel(nn.Module):
    """`Gemma4Target` plus its embedding tables as parameters (the token table is the tied LM
    head's weight)."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.cfg = cfg
        self.target = Gemma4Target(cfg)
        p = cfg.hidden_size_per_layer_input
        self.per_layer_table = (
            nn.Parameter(torch.zeros(cfg.vocab_size_per_layer_input, cfg.num_layers * p))
            if p
            else None
        )
        self.cache = EmptyCache(cfg)

    @property
    def tables(self) -> TokenTables:
        return TokenTables(
            self.target.lm_head.weight,
            self.per_layer_table,
            self.cfg.num_layers,
            self.cfg.hidden_size_per_layer_input,
        )

    def sequence_logits(self, ids: Tensor) -> Tensor:
        """ids [T] at positions 0..T-1 -> logits [T, vocab] (soft-capped)."""
        tables = self.tables
        positions = torch.arange(ids.shape[-1])
        hidden, _ = self.target(
            tables.embed(ids), tables.per_layer_inputs(ids), positions, self.cache, "all"
        )
        return self.target.logits(hidden)

    def forward(self, ids: Tensor) -> Tensor:
        """ids [B, T] -> logits [B, T, vocab]."""
        return torch.vmap(self.sequence_logits)(ids)


def init_weights(model: TrainModel, std: float, seed: int) -> None:
    """normal(0, std) for every matrix and table; norms and layer scalars stay at 1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def build_model(config: dict[str, Any], seed: int = 0) -> TrainModel:
    model = TrainModel(parse_text_config(config))
    init_weights(model, float(config.get("initializer_range", 0.02)), seed)
    return model


def loss_fn(model: TrainModel, ids: Tensor) -> Tensor:
    """Mean next-token cross-entropy over a batch [B, T]."""
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


# --- checkpoint in Hugging Face layout ---------------------------------------------------------


def hf_tensors(model: TrainModel) -> dict[str, Tensor]:
    """Checkpoint name -> tensor, the names `load_target` reads (tied head stored once)."""
    out = {}
    for key, t in model.target.state_dict().items():
        name = "model.embed_tokens.weight" if key == "lm_head.weight" else "model." + key
        out[name] = t
    if model.per_layer_table is not None:
        out["model.embed_tokens_per_layer.weight"] = model.per_layer_table.detach()
    return out


def save_checkpoint(model: TrainModel, config: dict[str, Any], out_dir: Path) -> None:
    """config.json, model.safetensors (float32), generation_config.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = hf_tensors(model)
    specs = tensor_specs(config)
    if {s.name for s in specs} != set(tensors):
        missing = {s.name for s in specs} ^ set(tensors)
        raise EdgeMTPError(f"checkpoint names disagree with the config: {sorted(missing)[:5]}")
    entries = [TensorEntry(s.name, "F32", tuple(s.shape)) for s in specs]

    def produce(entry: TensorEntry):
        yield tensors[entry.name].detach().float().contiguous().numpy()

    write_tensors(out_dir, entries, produce)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    gen = _generation_config(config)
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True))


# --- batches and schedule ----------------------------------------------------------------------


def random_batch(stream: np.ndarray, batch: int, seq: int, gen: np.random.Generator) -> Tensor:
    """`batch` samples of <bos> + seq-1 tokens from random offsets of the stream."""
    starts = gen.integers(0, len(stream) - seq, size=batch)
    rows = np.stack([stream[s : s + seq - 1] for s in starts]).astype(np.int64)
    bos = np.full((batch, 1), data.BOS_ID, dtype=np.int64)
    return torch.from_numpy(np.concatenate([bos, rows], axis=1))


def eval_batches(stream: np.ndarray, seq: int, max_seqs: int) -> list[Tensor]:
    """Consecutive non-overlapping windows of the held-out stream, each after a <bos>."""
    n = min(max_seqs, (len(stream)) // (seq - 1))
    rows = [stream[i * (seq - 1) : (i + 1) * (seq - 1)] for i in range(n)]
    ids = torch.from_numpy(np.stack(rows).astype(np.int64)) if rows else torch.zeros(0, seq - 1)
    ids = torch.cat([torch.full((n, 1), data.BOS_ID, dtype=torch.long), ids.long()], dim=1)
    return list(ids.split(8))


@torch.no_grad()
def evaluate(model: TrainModel, batches: list[Tensor]) -> float:
    """Mean held-out next-token loss (nats)."""
    model.eval()
    total, count = 0.0, 0
    for ids in batches:
        n = ids[:, 1:].numel()
        total += loss_fn(model, ids).item() * n
        count += n
    model.train()
    return total / max(count, 1)


def lr_at(progress: float, peak: float, warmup: float, floor: float = 0.1) -> float:
    """Linear warm-up over the first `warmup` of training, then cosine down to floor * peak."""
    if progress < warmup:
        return peak * progress / warmup
    t = min(1.0, (progress - warmup) / max(1e-9, 1 - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))


# --- the run -----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="edgemtp train-target",
        description="Pre-train the embedded default Gemma 4 target on the CPython stdlib.",
    )
    p.add_argument("--data", type=Path, required=True, help="data folder (prepared if empty)")
    p.add_argument("--out", type=Path, required=True, help="checkpoint folder to write")
    p.add_argument("--minutes", type=float, help="wall-clock budget for the training steps")
    p.add_argument("--steps", type=int, help="number of optimizer steps")
    p.add_argument(
        "--resume", action="store_true", help="continue from OUT.train_state.pt (saved as it goes)"
    )
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=float, default=0.05, help="fraction of training")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--save-every", type=int, default=200, help="steps between resume states")
    p.add_argument("--eval-seqs", type=int, default=128, help="held-out windows to evaluate")
    p.add_argument(
        "--size",
        default="default",
        choices=("default", "tiny"),
        help="tiny: a few-layer model for tests and smoke runs",
    )
    args = p.parse_args(argv)
    args.argv = [str(a) for a in (sys.argv[1:] if argv is None else argv)]  # for training.json
    if args.minutes is None and args.steps is None:
        p.error("give --minutes and/or --steps")
    if (args.steps is not None and args.steps < 1) or (
        args.minutes is not None and args.minutes <= 0
    ):
        p.error("--steps and --minutes must be positive")
    return args


def config_for(size: str) -> dict[str, Any]:
    if size == "tiny":
        return embedded_config(
            hidden=64, intermediate=128, heads=2, head_dim=16, global_head_dim=32, ple=8, window=16
        )
    return embedded_config()


def _optimizer(model: TrainModel, lr: float, weight_decay: float) -> torch.optim.AdamW:
    # Decay matrices and tables; never norms or layer scalars.
    decay = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim != 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def train(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run (or resume) pre-training; writes the checkpoint to args.out and returns the report
    that is also saved as training.json."""
    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    out: Path = args.out
    state_file = state_path(out)
    if args.resume and not state_file.is_file():
        raise EdgeMTPError(f"{state_file}: nothing to resume; run once without --resume")
    data.prepare(args.data, log=log)
    train_ids = data.load_ids(args.data, "train")
    held_ids = data.load_ids(args.data, "held_out")
    if len(train_ids) <= args.seq:
        raise EdgeMTPError(f"{args.data}: train split has only {len(train_ids)} tokens")
    out.mkdir(parents=True, exist_ok=True)
    (out / "training.json").unlink(missing_ok=True)  # written again when this run ends

    config = config_for(args.size)
    model = build_model(config, args.seed)
    opt = _optimizer(model, args.lr, args.weight_decay)
    step, elapsed, tokens_seen, curve, commands = 0, 0.0, 0, [], []
    gen = np.random.default_rng(args.seed)
    if args.resume:
        state = torch.load(state_file, weights_only=True)  # tensors and plain values only
        config = state["config"]
        model = build_model(config)
        model.load_state_dict(state["model"])
        opt = _optimizer(model, args.lr, args.weight_decay)
        opt.load_state_dict(state["optimizer"])
        step, elapsed = state["step"], state["elapsed"]
        tokens_seen, curve, commands = state["tokens"], state["curve"], state["commands"]
        gen.bit_generator.state = state["rng"]
        log(f"resumed at step {step} ({elapsed / 60:.1f} min, {tokens_seen} tokens)")
    commands.append(shlex.join(["python", "-m", "edgemtp.train.pretrain", *args.argv]))
    cfg = model.cfg
    log(
        f"model: {parameter_count(cfg) / 1e6:.2f} M parameters, {cfg.num_layers} layers "
        f"({cfg.num_kv_shared_layers} KV-shared), hidden {cfg.hidden_size}, vocab {cfg.vocab_size}"
    )
    budget = args.minutes * 60 if args.minutes else None

    def progress() -> float:
        fractions = [step / args.steps if args.steps else 0.0]
        fractions.append(elapsed / budget if budget else 0.0)
        return max(fractions)

    def save_state() -> None:
        state = {
            "config": config,
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "step": step,
            "elapsed": elapsed,
            "tokens": tokens_seen,
            "curve": curve,
            "commands": commands,
            "rng": gen.bit_generator.state,
        }
        tmp = state_file.with_suffix(".tmp")
        torch.save(state, tmp)
        tmp.replace(state_file)
        # a loadable checkpoint as we go (training.json appears only when the run is done)
        save_checkpoint(model, config, out)
        data.save_tokenizer(data.load_data_tokenizer(args.data), out)

    model.train()
    window_loss, window_n, window_t = 0.0, 0, 0.0
    while progress() < 1.0:
        t0 = time.perf_counter()
        lr = lr_at(progress(), args.lr, args.warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        ids = random_batch(train_ids, args.batch, args.seq, gen)
        loss = loss_fn(model, ids)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        step += 1
        tokens_seen += ids[:, 1:].numel()
        dt = time.perf_counter() - t0
        elapsed += dt
        window_loss, window_n, window_t = window_loss + loss.item(), window_n + 1, window_t + dt
        if step % args.log_every == 0 or progress() >= 1.0:
            mean = window_loss / window_n
            curve.append([step, round(mean, 4)])
            rate = window_n * ids[:, 1:].numel() / window_t
            eta = (1 - progress()) * elapsed / max(progress(), 1e-9)
            log(
                f"step {step:6d}  loss {mean:.4f}  lr {lr:.2e}  |g| {grad_norm:.2f}  "
                f"{rate:,.0f} tok/s  elapsed {elapsed / 60:.1f} min  ETA {eta / 60:.1f} min"
            )
            window_loss, window_n, window_t = 0.0, 0, 0.0
        if step % args.save_every == 0:
            save_state()
    save_state()

    held_batches = eval_batches(held_ids, args.seq, args.eval_seqs)
    held_loss = evaluate(model, held_batches)
    log(f"held-out loss {held_loss:.4f}  perplexity {math.exp(held_loss):.2f}")
    manifest = json.loads((Path(args.data) / "manifest.json").read_text())
    report = {
        "commands": commands,  # the first run, then each --resume
        "options": {
            k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "argv"
        },
        "train_seconds": round(elapsed, 1),
        "wall_seconds_this_run": round(time.perf_counter() - started, 1),
        "steps": step,
        "tokens_seen": tokens_seen,
        "batch": args.batch,
        "seq": args.seq,
        "peak_lr": args.lr,
        "parameters": parameter_count(cfg),
        "final_train_loss": curve[-1][1] if curve else None,
        "held_out_loss": round(held_loss, 4),
        "held_out_perplexity": round(math.exp(held_loss), 3),
        "held_out_tokens_evaluated": sum(b[:, 1:].numel() for b in held_batches),
        "train_tokens_available": int(len(train_ids)),
        "data": {
            "corpus": manifest["corpus"],
            "license": manifest["license"],
            "python_version": manifest["python_version"],
            "splits": {
                k: {f: v[f] for f in ("files", "bytes", "sha256")}
                for k, v in manifest["splits"].items()
            },
        },
        "loss_curve": curve,
    }
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    log(f"wrote {out}")
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        train(args, log=lambda msg: print(msg, flush=True))
    except EdgeMTPError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
