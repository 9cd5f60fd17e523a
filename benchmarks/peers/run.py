"""edgemtp against its peers on one checkpoint, on this machine, in one run.

    python benchmarks/peers/run.py [--work DIR] [--repeats 5] [--threads 2]
        [--systems llama.cpp edgemtp executorch-example transformers] [--report-only]
        [--baseline PYTHON]

From a fresh clone (the venv of the README's test command):
1. `edgemtp synth --preset peer-90m` (BRIEF §10's "PEER-90M", random weights, bf16), with a
   Gemma-style tokenizer.json of its 32768 tokens (llama.cpp's converter wants one; the text is
   never read: every system gets the same seeded random token ids);
2. llama.cpp from `llama-cpp-python`'s source distribution on PyPI (`pip download`; it vendors
   llama.cpp): `llama-bench` and `llama-quantize` built with CMake (native, AMX off: a
   `-march=native` build died here with SIGILL on an AMX instruction), the checkpoint converted
   with its own `convert_hf_to_gguf.py` (f32) and quantized by its `llama-quantize --pure` to Q4_0;
3. edgemtp: `edgemtp export --model <that Q4_0 GGUF> --backend executorch --delegate cpu`
   (the very blocks llama.cpp runs, not re-quantized), max context 4096, prefill chunk 128;
4. ExecuTorch's own exporter, `examples/models/gemma4/export_gemma4.py` from the `executorch`
   wheel, on the bf16 checkpoint (its default 8da4w+emb8, group 32, max_seq_len 4096), driven
   as its `run_gemma4.py` drives it: one `text_decoder` call per prefill and per token;
5. transformers' Gemma 4 on the bf16 checkpoint loaded in fp32, eager, KV cache kept.

Measured per system, every repeat in fresh processes, systems interleaved, medians reported:
pp512 and pp2048 (prefill tok/s from an empty context), tg128 (decode tok/s of 128 tokens after
one), and decode ms/token at context positions 16, 512 and 1800 (32 tokens decoded after a
prompt of that length). llama.cpp through `llama-bench -r 1` (`-p 512,2048 -n 128`, then
`-p 0 -n 32 -d 16,512,1800`); edgemtp through `Session.from_bundle` (greedy AR, no stop
tokens), the ExecuTorch example and transformers token by token from Python (argmax on the
host); decode tok/s = (n_out - 1) / (t_end - t_first) as everywhere in edgemtp. Each step of
the setup is cached in `--work` and reused. Writes benchmarks/results/peers.{json,md,png}.

`--isa avx2`: both sides held to AVX2 + FMA, as on an x86 machine without AVX-512: llama.cpp
built with GGML_NATIVE off and AVX-512 off (its own build folder), edgemtp's kernels the
`x86-64-v3` library (`EDGEMTP_KERNELS_ISA`); written to peers-avx2.{json,md,png}. XNNPACK
inside ExecuTorch still picks its microkernels for this CPU (prompt chunks run there).

`--baseline PYTHON`: one more system, "edgemtp-baseline", the edgemtp that PYTHON imports (a
venv over a checkout of another commit, e.g. the one before a change): it exports its own bundle
from the same GGUF and runs in its own processes, interleaved with the others, so a change is
measured side by side with what it changed (written to peers-baseline.{json,md,png}).
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
from functools import partial
from pathlib import Path
from typing import Any

# `python benchmarks/peers/run.py` puts only peers/ on sys.path; the shared harness and
# runtime_backends (and export_e2b, imported later) live one folder up.
BENCHMARKS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCHMARKS))

from harness import (  # noqa: E402
    RESULTS,
    log,
    machine,
    pyplot,
    save_figure,
    write_report,
    write_results,
)
from runtime_backends import HOST_PHASES  # noqa: E402

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
PROMPTS = (512, 2048)
DEPTHS = (16, 512, 1800)
DEPTH_TOKENS = 32
TG = 128
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
# --isa: llama.cpp's CMake flags and edgemtp's kernel library for each instruction-set limit
LLAMA_ISA = {
    "native": ["-DGGML_NATIVE=ON", f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"],
    "avx2": ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
             "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF", "-DGGML_AVX_VNNI=OFF"],
}  # fmt: skip
EDGEMTP_ISA = {"native": None, "avx2": "x86-64-v3"}


def run(cmd: list[str], stream: bool = False) -> str:
    """Run a command; `stream`: its output goes to this terminal (long steps show progress)."""
    log(" ".join(cmd))
    if stream:
        if subprocess.run(cmd, stdout=sys.stderr).returncode:
            sys.exit(f"failed: {' '.join(cmd)}")
        return ""
    # llama.cpp's tools print token pieces, which need not be valid UTF-8
    done = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
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


def source_commit() -> str:
    """The edgemtp commit these sources are (with `+dirty` for uncommitted changes)."""
    root = BENCHMARKS.parent
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True)
    dirty = subprocess.run(
        ["git", "-C", str(root), "status", "--porcelain", "--", "*.py"], capture_output=True
    )
    return head.stdout.decode().strip() + ("+dirty" if dirty.stdout.strip() else "")


def setup(work: Path, threads: int, isa: str = "native") -> dict[str, Path]:
    """Checkpoint, llama.cpp build, GGUF files and the edgemtp bundle, each made once."""
    python, edgemtp = sys.executable, str(Path(sys.executable).parent / "edgemtp")
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / "peer-90m"
    if not (ckpt / "tokenizer.json").is_file():
        run([edgemtp, "synth", "--preset", "peer-90m", "--out", str(ckpt), "--force"])
        gemma_style_tokenizer(ckpt, json.loads((ckpt / "config.json").read_text())["vocab_size"])

    llama = work / "llama.cpp"
    build = llama / ("build" if isa == "native" else f"build-{isa}")
    bench, quantize = build / "bin" / "llama-bench", build / "bin" / "llama-quantize"
    if not bench.is_file():
        if not llama.is_dir():
            run([python, "-m", "pip", "download", "-q", LLAMA_CPP_PYTHON, "--no-deps",
                 "--no-binary", ":all:", "-d", str(work)])  # fmt: skip
            sdist = next(work.glob("llama_cpp_python-*.tar.gz"))
            with tarfile.open(sdist) as tar:
                tar.extractall(work / "sdist", filter="data")
            shutil.move(next((work / "sdist").glob("*/vendor/llama.cpp")), llama)
        run(["cmake", "-S", str(llama), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
             "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_SERVER=OFF",
             "-DLLAMA_BUILD_TESTS=OFF", *LLAMA_ISA[isa]])  # fmt: skip
        jobs = str(os.cpu_count() or 2)
        run(["cmake", "--build", str(build), "-j", jobs, "--target", "llama-bench",
             "llama-quantize"], stream=True)  # fmt: skip

    f32, q4 = work / "peer-90m-f32.gguf", work / "peer-90m-q4_0.gguf"
    if not q4.is_file():
        run([python, str(llama / "convert_hf_to_gguf.py"), str(ckpt), "--outtype", "f32",
             "--outfile", str(f32)])  # fmt: skip
        # --pure: every tensor Q4_0 (by default the token and PLE tables become Q6_K), so
        # both systems run the same blocks
        run([str(quantize), "--pure", str(f32), str(q4), "Q4_0", str(threads)])

    bundle = work / "edgemtp-q4_0-executorch"
    stamp = work / "edgemtp-q4_0-executorch.commit"  # re-exported when the code changes
    commit = source_commit()
    fresh = stamp.is_file() and stamp.read_text() == commit
    if not (bundle / "manifest.json").is_file() or not fresh:
        run([edgemtp, "export", "--model", str(q4), "--quant", "auto", "--backend", "executorch",
             "--delegate", "cpu", "--max-context", "4096", "--prefill-chunk", "128",
             "--out", str(bundle), "--force"], stream=True)  # fmt: skip
        stamp.write_text(commit)
    return {"checkpoint": ckpt, "llama_bench": bench, "gguf": q4, "bundle": bundle}


def edgemtp_commit_of(python: str) -> str:
    """The commit of the edgemtp tree `python` imports (with `+dirty` for uncommitted .py)."""
    code = "import edgemtp, os; print(os.path.dirname(edgemtp.__file__))"
    root = run([python, "-c", code]).strip()
    head = run(["git", "-C", root, "rev-parse", "HEAD"]).strip()
    dirty = run(["git", "-C", root, "status", "--porcelain", "--", "*.py"]).strip()
    return head + ("+dirty" if dirty else "")


def setup_variant(work: Path, gguf: Path, python: str, name: str, flags: list[str]) -> Path:
    """A bundle of the same GGUF with the same flags and `flags`, exported by the edgemtp
    `python` imports (the baseline's; or this one's, with another option)."""
    bundle = work / f"{name}-q4_0-executorch"
    stamp = work / f"{name}-q4_0-executorch.commit"
    commit = edgemtp_commit_of(python) + " ".join(["", *flags])
    fresh = stamp.is_file() and stamp.read_text() == commit
    if not (bundle / "manifest.json").is_file() or not fresh:
        run([python, "-m", "edgemtp.cli", "export", "--model", str(gguf), "--quant", "auto",
             "--backend", "executorch", "--delegate", "cpu", "--max-context", "4096",
             "--prefill-chunk", "128", *flags, "--out", str(bundle), "--force"],
            stream=True)  # fmt: skip
        stamp.write_text(commit)
    return bundle


def setup_executorch_example(work: Path, ckpt: Path) -> Path:
    """ExecuTorch's own exporter (`examples/models/gemma4` of the wheel, as shipped) on the same
    checkpoint: its default 8da4w+emb8, group 32, XNNPACK, max_seq_len 4096. It quantizes the
    bf16 weights itself (it reads no GGUF). The checkpoint is renamed to its multimodal tensor
    names and its config flattened, as in `benchmarks/export_e2b.py` (whose shim is reused)."""
    from export_e2b import ET_SHIM, convert_for_executorch

    pte = work / "executorch-example" / "gemma4_text.pte"
    if pte.is_file():
        return pte
    converted = work / "peer-90m-executorch-names"
    convert_for_executorch(ckpt, converted)
    pte.parent.mkdir(parents=True, exist_ok=True)
    partial = pte.with_suffix(".partial")
    run([sys.executable, "-c", ET_SHIM, str(converted / "config.json"),
         "--checkpoint_path", str(converted), "--output_path", str(partial),
         "--max_seq_len", "4096", "--quantize", "8da4w+emb8", "--group_size", "32",
         "--no-audio", "--no-vision"], stream=True)  # fmt: skip
    partial.rename(pte)
    return pte


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
    tg = session.generate([2], TG + 1, mtp=0, stop_ids=()).metrics()
    out[f"tg{TG}"] = tg["decode_tok_s"]
    out["kv_cache_bytes"] = session.info.get("kv_cache_bytes")  # (None: an older edgemtp)
    # The Python host's share of the decode step, from the runtime's own phase meter in this
    # very run: embedding lookups, sampling and the loop, against the whole step.
    phases = tg["decode_seconds_by_phase"]
    out["host_share"] = sum(phases[p] for p in HOST_PHASES) / sum(phases.values())
    for d in DEPTHS:
        session.reset()
        tok_s = session.generate(random_ids(d, vocab), DEPTH_TOKENS + 1, mtp=0, stop_ids=())
        out[f"ms_at_{d}"] = 1000 / tok_s.metrics()["decode_tok_s"]
    return out


def timed_loop(prefill: Any, step: Any, vocab: int) -> dict[str, Any]:
    """The figures of `edgemtp_child` for a system driven token by token from Python:
    `prefill(ids) -> next token` from an empty context, `step(token, position) -> next token`.
    Decode tok/s = tokens after the first / their time, as edgemtp's metrics."""

    def decode(prompt: list[int], n: int) -> float:
        token = prefill(prompt)
        start = time.perf_counter()
        for i in range(n):
            token = step(token, len(prompt) + i)
        return n / (time.perf_counter() - start)

    decode(random_ids(200, vocab), 16)  # warm-up
    out: dict[str, Any] = {}
    for n in PROMPTS:
        ids = random_ids(n, vocab)
        start = time.perf_counter()
        prefill(ids)
        out[f"pp{n}"] = n / (time.perf_counter() - start)
    out[f"tg{TG}"] = decode([2], TG)
    for d in DEPTHS:
        out[f"ms_at_{d}"] = 1000 / decode(random_ids(d, vocab), DEPTH_TOKENS)
    return out


def executorch_example_child(pte: Path, threads: int) -> dict[str, Any]:
    """ExecuTorch's example program driven as its own `run_gemma4.py` drives it: one
    `text_decoder` call per prefill (all rows) and per decode token, argmax on the host."""
    import torch
    from executorch.extension.llm.custom_ops import custom_ops  # noqa: F401  its custom_sdpa
    from executorch.extension.pybindings import portable_lib
    from executorch.kernels import quantized  # noqa: F401  its int8 embedding kernels
    from executorch.runtime import Runtime

    torch.set_num_threads(threads)
    portable_lib._unsafe_reset_threadpool(threads)
    method = Runtime.get().load_program(pte).load_method("text_decoder")
    config = json.loads((pte.parents[1] / "peer-90m" / "config.json").read_text())
    hidden = config["hidden_size"]

    def call(ids: list[int], start: int) -> int:
        logits = method.execute(
            [
                torch.tensor([ids]),
                torch.arange(start, start + len(ids)),
                torch.zeros(1, len(ids), hidden),
            ]
        )[0]
        return int(logits[0, -1].argmax())

    return timed_loop(lambda ids: call(ids, 0), lambda t, pos: call([t], pos), config["vocab_size"])


def transformers_child(ckpt: Path, threads: int) -> dict[str, Any]:
    """transformers' Gemma 4 on the float checkpoint (fp32 on CPU: its bf16 matmuls are slower
    here), eager, KV cache kept between calls, argmax on the host."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    state: dict[str, Any] = {}

    @torch.inference_mode()
    def prefill(ids: list[int]) -> int:
        out = model(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1)
        state["cache"] = out.cache
        return int(out.logits[0, -1].argmax())

    @torch.inference_mode()
    def step(token: int, position: int) -> int:  # the cache knows the position
        out = model(input_ids=torch.tensor([[token]]), cache=state["cache"], use_cache=True)
        state["cache"] = out.cache
        return int(out.logits[0, -1].argmax())

    return timed_loop(prefill, step, model.config.vocab_size)


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


def measure(
    paths: dict[str, Path], systems: list[str], repeats: int, threads: int, baseline: str | None
) -> dict:
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    for r in range(repeats):
        for system in systems:
            log(f"repeat {r + 1}/{repeats}: {system}")
            if system == "llama.cpp":
                runs[system].append(llama_cpp_once(paths["llama_bench"], paths["gguf"], threads))
                continue
            python, child = sys.executable, system
            if system == BASELINE:  # another edgemtp, in its own interpreter
                python, child = baseline or sys.executable, "edgemtp"
            if system == INT8_KV:
                child = "edgemtp"
            cmd = [python, __file__, "--child", child, str(paths[CHILD_INPUT[system]])]
            runs[system].append(json.loads(run([*cmd, "--threads", str(threads)])))
    return runs


SYSTEMS = ("llama.cpp", "edgemtp", "executorch-example", "transformers")
CHILDREN = {
    "edgemtp": edgemtp_child,
    "executorch-example": executorch_example_child,
    "transformers": transformers_child,
}
BASELINE = "edgemtp-baseline"
INT8_KV = "edgemtp-int8-kv"  # the same export with --kv-cache int8
CHILD_INPUT = {"edgemtp": "bundle", "executorch-example": "et_pte", "transformers": "checkpoint"}
CHILD_INPUT[BASELINE] = "baseline_bundle"
CHILD_INPUT[INT8_KV] = "int8_kv_bundle"

KEYS = [f"pp{n}" for n in PROMPTS] + [f"tg{TG}"] + [f"ms_at_{d}" for d in DEPTHS]


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    return {s: {k: statistics.median(r[k] for r in rs) for k in KEYS} for s, rs in runs.items()}


def paired_ratios(result: dict, a: str, b: str, key: str) -> list[float]:
    """a / b within each repeat (the systems of a repeat run back to back): a ratio that a
    slow minute of this shared machine moves less than it moves a ratio of medians."""
    runs = result["runs"]
    return [x[key] / y[key] for x, y in zip(runs[a], runs[b], strict=True)]


def _paired(result: dict, a: str, b: str, keys: list[str]) -> str:
    parts = []
    for key in keys:
        ratios = paired_ratios(result, a, b, key)
        parts.append(
            f"{key} {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
        )
    return ", ".join(parts)


def report(result: dict) -> str:
    med = result["medians"]
    lines = [
        "# edgemtp vs its peers on PEER-90M"
        + ("" if result.get("isa", "native") == "native" else f", both held to {result['isa']}"),
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
            "",
            "Per repeat, then the median (range): edgemtp / llama.cpp "
            + _paired(result, "edgemtp", "llama.cpp", ["pp512", "pp2048", "tg128"]),
        ]
    shares = [r["host_share"] for r in result["runs"].get("edgemtp", []) if "host_share" in r]
    if shares:
        lines.append(
            f"\nedgemtp's Python host (embedding lookups, sampling, the loop) in tg{TG}: "
            f"{100 * statistics.median(shares):.1f} % of the decode step "
            f"({100 * min(shares):.1f}-{100 * max(shares):.1f} % per repeat; the runtime's phase "
            "meter, same run)"
        )
    if BASELINE in med and "edgemtp" in med:
        lines.append(
            "\nPer repeat, then the median (range): edgemtp / edgemtp-baseline "
            f"({result.get('baseline_commit', '?')[:12]}) "
            + _paired(result, "edgemtp", BASELINE, [f"pp{n}" for n in PROMPTS] + [f"tg{TG}"])
        )
    if INT8_KV in med and "edgemtp" in med:
        a, b = med[INT8_KV], med["edgemtp"]
        kv = {s: result["runs"][s][0].get("kv_cache_bytes") for s in (INT8_KV, "edgemtp")}
        lines += [
            "",
            f"int8 KV cache: decode @1800 / @16 {a['ms_at_1800'] / a['ms_at_16']:.2f} (float16 "
            f"{b['ms_at_1800'] / b['ms_at_16']:.2f}); KV cache "
            f"{kv[INT8_KV] / 2**20:.2f} MiB (float16 {kv['edgemtp'] / 2**20:.2f} MiB, "
            f"{kv[INT8_KV] / kv['edgemtp']:.3f}x)",
            "",
            "Per repeat, then the median (range): int8 / float16 KV cache "
            + _paired(result, INT8_KV, "edgemtp", [f"pp{n}" for n in PROMPTS] + [f"tg{TG}"])
            + "; ms/token "
            + _paired(result, INT8_KV, "edgemtp", [f"ms_at_{d}" for d in DEPTHS]),
        ]
    if "executorch-example" in med and "edgemtp" in med:
        ratio = med["edgemtp"]["tg128"] / med["executorch-example"]["tg128"]
        lines.append(f"\nedgemtp / ExecuTorch's example: tg128 {ratio:.2f}x")
        lines.append(
            "\nPer repeat, then the median (range): edgemtp / ExecuTorch's example "
            + _paired(result, "edgemtp", "executorch-example", ["tg128"])
        )
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
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
        ax.legend(fontsize=7)
    for s in systems:
        axes[2].plot(DEPTHS, [med[s][f"ms_at_{d}"] for d in DEPTHS], "o-", label=s)
    axes[2].set_xlabel("context position")
    axes[2].set_ylabel("decode ms/token (log)")
    axes[2].set_yscale("log")
    axes[2].set_title("decode cost by position")
    axes[2].legend(fontsize=7)
    fig.suptitle(f"PEER-90M Q4_0, {result['threads']} threads")
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/edgemtp-peers"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)  # SYSTEM PATH: one run
    parser.add_argument(
        "--report-only", action="store_true", help="redraw peers.md/png from peers.json"
    )
    parser.add_argument(
        "--baseline", metavar="PYTHON", help="also measure the edgemtp this Python imports"
    )
    parser.add_argument(
        "--isa", choices=list(LLAMA_ISA), default="native", help="instruction sets both may use"
    )
    parser.add_argument(
        "--kv-cache-int8",
        action="store_true",
        help=f"also measure {INT8_KV}: the same bundle exported with --kv-cache int8",
    )
    args = parser.parse_args()
    stem = RESULTS / ("peers-baseline" if args.baseline else "peers")
    if args.kv_cache_int8:
        stem = stem.with_name(f"{stem.name}-kv-int8")
    if args.isa != "native":
        stem = stem.with_name(f"{stem.name}-{args.isa}")
        os.environ["EDGEMTP_KERNELS_ISA"] = EDGEMTP_ISA[args.isa]  # the children inherit it
    if args.report_only:
        result = json.loads(stem.with_suffix(".json").read_text())
        text = report(result)
        write_report(stem, text, partial(plot, result))
        print(text)
        return
    if args.child:
        system, path = args.child
        print(json.dumps(CHILDREN[system](Path(path), args.threads)))
        return
    paths = setup(args.work, args.threads, args.isa)
    if "executorch-example" in args.systems:
        paths["et_pte"] = setup_executorch_example(args.work, paths["checkpoint"])
    systems = list(args.systems)
    if args.baseline:
        paths["baseline_bundle"] = setup_variant(
            args.work, paths["gguf"], args.baseline, BASELINE, []
        )
        systems.insert(systems.index("edgemtp") + 1 if "edgemtp" in systems else 0, BASELINE)
    if args.kv_cache_int8:
        paths["int8_kv_bundle"] = setup_variant(
            args.work, paths["gguf"], sys.executable, INT8_KV, ["--kv-cache", "int8"]
        )
        systems.insert(systems.index("edgemtp") + 1 if "edgemtp" in systems else 0, INT8_KV)
    runs = measure(paths, systems, args.repeats, args.threads, args.baseline)
    result = {
        "command": "python " + " ".join(sys.argv),
        "edgemtp_commit": source_commit(),
        "baseline_commit": edgemtp_commit_of(args.baseline) if args.baseline else None,
        "date": datetime.date.today().isoformat(),
        "machine": machine(args.threads),
        "threads": args.threads,
        "repeats": args.repeats,
        "isa": args.isa,
        "checkpoint": "edgemtp synth --preset peer-90m (random weights), Q4_0 by llama-quantize",
        "llama_cpp": f"{LLAMA_CPP_PYTHON} sdist's vendored llama.cpp",
        "runs": runs,
        "medians": summarize(runs),
    }
    text = report(result)
    write_results(stem, result, text, partial(plot, result))
    print(text)


if __name__ == "__main__":
    main()
