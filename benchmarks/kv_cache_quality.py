"""What an int8 KV cache costs in quality, on the embedded pair's held-out text (issue 42).

    python benchmarks/kv_cache_quality.py [--contexts 512,2048] [--windows 3] [--mtp-tokens 64]

Text: the CPython standard library files the embedded pair never trained on
(`edgemtp.train.data.is_held_out`), encoded as its held-out evaluation encoded them (each
file's tokens, then <eos>). Per context length L, `--windows` windows of L consecutive tokens
(a <bos> first) are teacher-forced through the reference engine one token at a time, as
decoding reads its cache: each row attends to the cached rows before it and to its own K/V as
the cache will store it. Once over an fp16 cache (what the bundles store by default) and once
over int8 (`--kv-cache int8`: symmetric, a float32 scale per token and KV head): per token
KL(fp16 || int8) of the next-token distributions, top-1 agreement, and both perplexities over
the next tokens. Then MTP: the demo's held-out prompts decoded greedily at depth 3 with the
assistant over each cache (`--mtp-tokens` each): acceptance by draft position, and how many
leading tokens the two caches decode alike.
Writes results/kv_cache_quality.{json,md,png}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import time
from pathlib import Path

import torch
from harness import RESULTS, command_line, log, machine, pyplot, save_figure, write_results

from edgemtp.model.cache import KV_CACHE_DTYPES, KVCache
from edgemtp.model.embedded import ASSISTANT, PROMPTS, TARGET
from edgemtp.model.forward import forward_rows
from edgemtp.quantize.load import load_drafter, load_target
from edgemtp.runtime.generate import generate
from edgemtp.runtime.tokenizer import load_tokenizer
from edgemtp.train.data import (
    encode_documents,
    read_source,
    source_files,
    split_files,
    stdlib_dir,
)

CACHES = ("fp16", "int8")


def held_out_ids() -> list[int]:
    """The held-out stream as the pair's evaluation read it: each file's tokens, then <eos>."""
    root = stdlib_dir()
    files = split_files(source_files(root))["held_out"]
    docs = [text for rel in files if (text := read_source(root, rel)) is not None]
    tokenizer = load_tokenizer(TARGET)
    assert tokenizer is not None
    return encode_documents(tokenizer.tokenizer, docs).astype(int).tolist()


def teacher_forced(target, ids: list[int], kv_cache: str) -> torch.Tensor:
    """Log-probabilities [len(ids), vocab] of each next token, one row at a time."""
    cache = KVCache(target.cfg, len(ids), 0, KV_CACHE_DTYPES[kv_cache])
    out = []
    with torch.no_grad():
        for token in ids:
            hidden = forward_rows(target, cache, torch.tensor([token]), "all")
            out.append(torch.log_softmax(target.model.logits(hidden[0]).double(), -1))
    return torch.stack(out)


def window_metrics(target, window: list[int]) -> dict[str, float]:
    f, q = (teacher_forced(target, window[:-1], c) for c in CACHES)
    labels = torch.tensor(window[1:])[:, None]
    return {
        "tokens": len(labels),
        "kl_sum": float((f.exp() * (f - q)).sum()),
        "agree": int((f.argmax(-1) == q.argmax(-1)).sum()),
        "nll_fp16": -float(f.gather(1, labels).sum()),
        "nll_int8": -float(q.gather(1, labels).sum()),
    }


def acceptance(target, drafter, prompts: list[list[int]], tokens: int, kv_cache: str) -> dict:
    """Greedy MTP at depth 3 over the cache: acceptance by draft position, and the tokens."""
    drafted, accepted, outputs = [0, 0, 0], [0, 0, 0], []
    for prompt in prompts:
        gen = generate(target, prompt, tokens, drafter=drafter, mtp_depth=3, kv_cache=kv_cache)
        outputs.append(gen.tokens)
        for step in gen.steps:
            for i in range(step.drafted):
                drafted[i] += 1
                accepted[i] += step.accepted > i
    rate = [a / d if d else 0.0 for a, d in zip(accepted, drafted, strict=True)]
    return {"by_position": rate, "drafted": drafted, "tokens": outputs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="512,2048", help="window lengths, comma-separated")
    ap.add_argument("--windows", type=int, default=3, help="windows per context length")
    ap.add_argument("--mtp-tokens", type=int, default=64, help="tokens per MTP prompt")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=RESULTS / "kv_cache_quality")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    target = load_target(TARGET)
    drafter = load_drafter(ASSISTANT, target.cfg)
    ids = held_out_ids()
    bos = target.cfg.bos_token_id
    log(f"held-out text: {len(ids)} tokens")
    contexts = {}
    for length in (int(c) for c in args.contexts.split(",")):
        stride = (len(ids) - length) // max(1, args.windows)
        rows = []
        for w in range(args.windows):
            window = [bos, *ids[w * stride : w * stride + length]]
            rows.append(window_metrics(target, window))
            log(f"context {length}, window {w + 1}/{args.windows}: {rows[-1]['agree']} agree")
        n = sum(r["tokens"] for r in rows)
        contexts[length] = {
            "windows": rows,
            "kl_per_token": sum(r["kl_sum"] for r in rows) / n,
            "top1_agreement": sum(r["agree"] for r in rows) / n,
            "perplexity_fp16": math.exp(sum(r["nll_fp16"] for r in rows) / n),
            "perplexity_int8": math.exp(sum(r["nll_int8"] for r in rows) / n),
        }
    tokenizer = load_tokenizer(TARGET)
    assert tokenizer is not None
    prompts = [[bos, *tokenizer.encode_prompt(p)] for p in json.loads(PROMPTS.read_text())]
    mtp = {c: acceptance(target, drafter, prompts, args.mtp_tokens, c) for c in CACHES}
    # per prompt: how many leading tokens the two caches decode alike
    same = [
        next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
        for x, y in zip(mtp["fp16"]["tokens"], mtp["int8"]["tokens"], strict=True)
    ]
    result = {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "command": command_line("kv_cache_quality.py"),
        "machine": machine(args.threads),
        "held_out_tokens": len(ids),
        "contexts": contexts,
        "mtp": {c: {k: v for k, v in m.items() if k != "tokens"} for c, m in mtp.items()},
        "mtp_tokens_alike": same,
        "seconds": round(time.perf_counter() - start, 1),
    }
    lines = [
        "# int8 KV cache: quality on the embedded pair's held-out text",
        "",
        f"`{result['command']}` ({result['date']}, {result['seconds']} s; "
        f"{len(ids)} held-out tokens).",
        "",
        "| context | tokens scored | KL(fp16 ‖ int8) per token | top-1 agreement | "
        "perplexity fp16 | perplexity int8 | change |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for length, c in contexts.items():
        change = c["perplexity_int8"] / c["perplexity_fp16"] - 1
        lines.append(
            f"| {length} | {sum(r['tokens'] for r in c['windows'])} | {c['kl_per_token']:.2e} | "
            f"{c['top1_agreement']:.2%} | {c['perplexity_fp16']:.3f} | "
            f"{c['perplexity_int8']:.3f} | {change:+.2%} |"
        )
    lines += [
        "",
        f"MTP (depth 3, greedy, {len(prompts)} held-out prompts x {args.mtp_tokens} tokens), "
        "acceptance by draft position:",
        "",
        "| cache | position 1 | position 2 | position 3 |",
        "|---|---:|---:|---:|",
        *(
            f"| {c} | " + " | ".join(f"{r:.3f}" for r in mtp[c]["by_position"]) + " |"
            for c in CACHES
        ),
        "",
        f"Leading tokens alike over the int8 and the fp16 cache, per prompt: "
        f"{', '.join(f'{n}/{args.mtp_tokens}' for n in same)}.",
        "",
    ]

    def plot(path: Path) -> None:
        plt = pyplot()
        fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4))
        lengths = [str(x) for x in contexts]
        a.bar(lengths, [c["top1_agreement"] * 100 for c in contexts.values()], color="#4c72b0")
        a.axhline(99, color="gray", ls="--", lw=1, label="goal 99 %")
        a.set_ylim(95, 100.2)
        a.set_xlabel("context (tokens)")
        a.set_ylabel("top-1 agreement with fp16 (%)")
        a.legend(loc="lower right")
        for i, c in enumerate(CACHES):
            b.bar([p + i * 0.38 for p in range(3)], mtp[c]["by_position"], 0.38, label=c)
        b.set_xticks([p + 0.19 for p in range(3)], ["1", "2", "3"])
        b.set_xlabel("draft position")
        b.set_ylabel("acceptance")
        b.legend()
        fig.suptitle("int8 KV cache vs fp16, embedded pair, held-out text")
        save_figure(fig, path)

    write_results(args.out, result, "\n".join(lines), plot)
    log(f"wrote {args.out}.json/.md/.png")


if __name__ == "__main__":
    main()
