"""edgemtp against its peers on one checkpoint, on this machine, in one run.

    python benchmarks/peers/run.py [--work DIR] [--repeats 5] [--threads 2]
        [--systems llama.cpp edgemtp]

From a fresh clone (the venv of the README's test command):
1. `edgemtp synth --preset peer-90m` (BRIEF §10's "PEER-90M", random weights, bf16), with a
   Gemma-style tokenizer.json of its 32768 tokens (llama.cpp's converter wants one; the text is
   never read: every system gets the same seeded random token ids);
2. llama.cpp from `llama-cpp-python`'s source distribution on PyPI (`pip download`; it vendors
   llama.cpp): `llama-bench` and `llama-quantize` built with CMake (native, AMX off: a
   `-march=native` build died here with SIGILL on an AMX instruction), the checkpoint converted
   with its own `convert_hf_to_gguf.py` (f32) and quantized by its `llama-quantize --pure` to Q4_0;
3. edgemtp: `edgemtp export --model <that Q4_0 GGUF> --backend executorch --delegate cpu`
   (the very blocks llama.cpp runs, not re-quantized), max context 4096, prefill chunk 128.

Measured per system, every repeat in fresh processes, systems interleaved, medians reported:
pp512 and pp2048 (prefill tok/s from an empty context), tg128 (decode tok/s of 128 tokens after
one), and decode ms/token at context positions 16, 512 and 1800 (32 tokens decoded after a
prompt of that length). llama.cpp through `llama-bench -r 1` (`-p 512,2048 -n 128`, then
`-p 0 -n 32 -d 16,512,1800`); edgemtp through `Session.from_bundle` (greedy AR, no stop
tokens), decode tok/s = (n_out - 1) / (t_end - t_first) as everywhere in edgemtp. Each step of
the setup is cached in `--work` and reused. Writes benchmarks/results/peers.{json,md,png}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCHMARKS))

from runtime_backends import machine  # noqa: E402

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
RESULTS = BENCHMARKS / "results"
PROMPTS = (512, 2048)
DEPTHS = (16, 512, 1800)
DEPTH_TOKENS = 32
TG = 128
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run(cmd: list[str], stream: bool = False) -> str:
    """Run a command; `stream`: its output goes to this terminal (long steps show progress)."""
    log(" ".join(cmd))
    if stream:
        if subprocess.run(cmd, stdout=sys.stderr).returncode:
            sys.exit(f"failed: {' '.join(cmd)}")
        return ""
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"failed ({done.returncode}): {' '.join(cmd)}\n{done.stderr[-4000:]}")
    return done.stdout


def gemma_style_tokenizer(folder: Path, vocab_size: int) -> None:
    """A byte-fallback BPE tokenizer.json in Gemma's layout with exactly `vocab_size` tokens
    (specials, 256 byte tokens, an alphabet of CJK characters and their pairs, each pair with
    its merge: llama.cpp's gemma4 vocabulary wants merges), and the tokenizer_config.json
    transformers loads it with: what llama.cpp's converter needs from a checkpoint folder."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    pieces = specials + [f"<0x{b:02X}>" for b in range(256)]
    alphabet = [chr(0x4E00 + i) for i in range(256)]
    pieces += alphabet
    pairs = [(a, b) for a in alphabet for b in alphabet][: vocab_size - len(pieces)]
    pieces += [a + b for a, b in pairs]
    bpe = models.BPE(
        vocab={p: i for i, p in enumerate(pieces)},
        merges=pairs,
        unk_token="<unk>",
        byte_fallback=True,
        fuse_unk=True,
    )
    tokenizer = Tokenizer(bpe)
    tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tokenizer.add_special_tokens(specials)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    config |= {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config | {"unk_token": "<unk>"}))


def setup(work: Path, threads: int) -> dict[str, Path]:
    """Checkpoint, llama.cpp build, GGUF files and the edgemtp bundle, each made once."""
    python, edgemtp = sys.executable, str(Path(sys.executable).parent / "edgemtp")
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / "peer-90m"
    if not (ckpt / "tokenizer.json").is_file():
        run([edgemtp, "synth", "--preset", "peer-90m", "--out", str(ckpt), "--force"])
        gemma_style_tokenizer(ckpt, json.loads((ckpt / "config.json").read_text())["vocab_size"])

    llama = work / "llama.cpp"
    bench, quantize = (
        llama / "build" / "bin" / "llama-bench",
        llama / "build" / "bin" / "llama-quantize",
    )
    if not bench.is_file():
        if not llama.is_dir():
            run([python, "-m", "pip", "download", "-q", LLAMA_CPP_PYTHON, "--no-deps",
                 "--no-binary", ":all:", "-d", str(work)])  # fmt: skip
            sdist = next(work.glob("llama_cpp_python-*.tar.gz"))
            with tarfile.open(sdist) as tar:
                tar.extractall(work / "sdist", filter="data")
            shutil.move(next((work / "sdist").glob("*/vendor/llama.cpp")), llama)
        flags = [f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]
        run(["cmake", "-S", str(llama), "-B", str(llama / "build"), "-DCMAKE_BUILD_TYPE=Release",
             "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_SERVER=OFF",
             "-DLLAMA_BUILD_TESTS=OFF", "-DGGML_NATIVE=ON", *flags])  # fmt: skip
        jobs = str(os.cpu_count() or 2)
        run(["cmake", "--build", str(llama / "build"), "-j", jobs, "--target", "llama-bench",
             "llama-quantize"], stream=True)  # fmt: skip

    f32, q4 = work / "peer-90m-f32.gguf", work / "peer-90m-q4_0.gguf"
    if not q4.is_file():
        run([python, str(llama / "convert_hf_to_gguf.py"), str(ckpt), "--outtype", "f32",
             "--outfile", str(f32)])  # fmt: skip
        # --pure: every tensor Q4_0 (by default the token and PLE tables become Q6_K), so
        # both systems run the same blocks
        run([str(quantize), "--pure", str(f32), str(q4), "Q4_0", str(threads)])

    bundle = work / "edgemtp-q4_0-executorch"
    if not (bundle / "manifest.json").is_file():
        run([edgemtp, "export", "--model", str(q4), "--quant", "auto", "--backend", "executorch",
             "--delegate", "cpu", "--max-context", "4096", "--prefill-chunk", "128",
             "--out", str(bundle), "--force"], stream=True)  # fmt: skip
    return {"checkpoint": ckpt, "llama_bench": bench, "gguf": q4, "bundle": bundle}


def random_ids(n: int, vocab: int) -> list[int]:
    import torch

    return torch.randint(3, vocab, (n,), generator=torch.manual_seed(n)).tolist()


def edgemtp_child(bundle: Path, threads: int) -> dict[str, Any]:
    """One fresh process: load the bundle, warm up, measure every figure once."""
    import torch

    from edgemtp.runtime.session import Session

    torch.set_num_threads(threads)
    session = Session.from_bundle(bundle, threads=threads, verify=False)
    vocab = session.backend.vocab_size
    session.generate(random_ids(200, vocab), 16, mtp=0, stop_ids=())  # warm-up: every method
    out: dict[str, Any] = {}
    for n in PROMPTS:
        session.reset()
        out[f"pp{n}"] = session.generate(random_ids(n, vocab), 1, stop_ids=()).metrics()[
            "prefill_tok_s"
        ]
    session.reset()
    out[f"tg{TG}"] = session.generate([2], TG + 1, mtp=0, stop_ids=()).metrics()["decode_tok_s"]
    for d in DEPTHS:
        session.reset()
        tok_s = session.generate(random_ids(d, vocab), DEPTH_TOKENS + 1, mtp=0, stop_ids=())
        out[f"ms_at_{d}"] = 1000 / tok_s.metrics()["decode_tok_s"]
    return out


def llama_cpp_once(bench: Path, gguf: Path, threads: int) -> dict[str, Any]:
    common = [str(bench), "-m", str(gguf), "-t", str(threads), "-r", "1", "-o", "json"]
    out: dict[str, Any] = {}
    rows = json.loads(run([*common, "-p", ",".join(map(str, PROMPTS)), "-n", str(TG)]))
    for row in rows:
        if row["n_prompt"]:
            out[f"pp{row['n_prompt']}"] = row["avg_ts"]
        else:
            out[f"tg{row['n_gen']}"] = row["avg_ts"]
    depths = ",".join(map(str, DEPTHS))
    rows = json.loads(run([*common, "-p", "0", "-n", str(DEPTH_TOKENS), "-d", depths]))
    for row in rows:
        out[f"ms_at_{row['n_depth']}"] = 1000 / row["avg_ts"]
    out["build"] = {k: rows[0].get(k) for k in ("build_commit", "build_number", "cpu_info")}
    return out


def measure(paths: dict[str, Path], systems: list[str], repeats: int, threads: int) -> dict:
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    for r in range(repeats):
        for system in systems:
            log(f"repeat {r + 1}/{repeats}: {system}")
            if system == "llama.cpp":
                runs[system].append(llama_cpp_once(paths["llama_bench"], paths["gguf"], threads))
            else:
                cmd = [sys.executable, __file__, "--child", str(paths["bundle"])]
                runs[system].append(json.loads(run([*cmd, "--threads", str(threads)])))
    return runs


KEYS = [f"pp{n}" for n in PROMPTS] + [f"tg{TG}"] + [f"ms_at_{d}" for d in DEPTHS]


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    return {s: {k: statistics.median(r[k] for r in rs) for k in KEYS} for s, rs in runs.items()}


def report(result: dict) -> str:
    med = result["medians"]
    lines = [
        "# edgemtp vs its peers on PEER-90M",
        "",
        f"`{result['command']}` ({result['date']}; {result['machine']['cpu']}, "
        f"{result['threads']} threads; medians of {result['repeats']} interleaved fresh runs)",
        "",
        "| system | pp512 tok/s | pp2048 tok/s | tg128 tok/s | ms/token @16 | @512 | @1800 |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for system, m in med.items():
        lines.append(
            f"| {system} | {m['pp512']:.0f} | {m['pp2048']:.0f} | {m['tg128']:.1f} | "
            f"{m['ms_at_16']:.2f} | {m['ms_at_512']:.2f} | {m['ms_at_1800']:.2f} |"
        )
    if "llama.cpp" in med and "edgemtp" in med:
        a, b = med["edgemtp"], med["llama.cpp"]
        lines += [
            "",
            f"edgemtp / llama.cpp: pp512 {a['pp512'] / b['pp512']:.2f}x, "
            f"pp2048 {a['pp2048'] / b['pp2048']:.2f}x, tg128 {a['tg128'] / b['tg128']:.2f}x; "
            f"edgemtp decode @1800 / @16: {a['ms_at_1800'] / a['ms_at_16']:.2f}",
        ]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    med = result["medians"]
    systems = list(med)
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, keys, title in (
        (axes[0], [f"pp{n}" for n in PROMPTS], "prefill tok/s"),
        (axes[1], [f"tg{TG}"], "decode tok/s (tg128)"),
    ):
        width = 0.8 / len(systems)
        for i, s in enumerate(systems):
            xs = [j + i * width for j in range(len(keys))]
            ax.bar(xs, [med[s][k] for k in keys], width, label=s)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(keys))], keys)
        ax.set_title(title)
        ax.legend()
    for s in systems:
        axes[2].plot(DEPTHS, [med[s][f"ms_at_{d}"] for d in DEPTHS], "o-", label=s)
    axes[2].set_xlabel("context position")
    axes[2].set_ylabel("decode ms/token")
    axes[2].set_ylim(bottom=0)
    axes[2].set_title("decode cost by position")
    axes[2].legend()
    fig.suptitle(f"PEER-90M Q4_0, {result['threads']} threads")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/edgemtp-peers"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--systems", nargs="+", default=["llama.cpp", "edgemtp"])
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)  # an edgemtp run
    args = parser.parse_args()
    if args.child:
        print(json.dumps(edgemtp_child(args.child, args.threads)))
        return
    paths = setup(args.work, args.threads)
    runs = measure(paths, args.systems, args.repeats, args.threads)
    result = {
        "command": "python " + " ".join(sys.argv),
        "date": datetime.date.today().isoformat(),
        "machine": machine(args.threads),
        "threads": args.threads,
        "repeats": args.repeats,
        "checkpoint": "edgemtp synth --preset peer-90m (random weights), Q4_0 by llama-quantize",
        "llama_cpp": f"{LLAMA_CPP_PYTHON} sdist's vendored llama.cpp",
        "runs": runs,
        "medians": summarize(runs),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "peers.json").write_text(json.dumps(result, indent=1) + "\n")
    text = report(result)
    (RESULTS / "peers.md").write_text(text)
    plot(result, RESULTS / "peers.png")
    print(text)


if __name__ == "__main__":
    main()
