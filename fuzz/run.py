"""Coverage-guided fuzzing (atheris + libFuzzer) of edgemtp's readers of outside input.

    python fuzz/run.py [TARGET ...] [--seconds 600] [--work DIR] [--out fuzz/results.json]

Targets (`fuzz/targets.py`): safetensors, gguf, config, quantization_config, shard_index,
tokenizer, manifest. Each runs in its own process for `--seconds`, starting from a corpus seeded
with files edgemtp and the tests build (a safetensors file of four dtypes, the tiny/e2b presets'
target and assistant configs, a tiny Gemma 4 GGUF written like the GGUF tests write theirs, our
compressed-tensors W4A16 configs, a shard index, a small BPE tokenizer.json, the manifest of a
tiny ExecuTorch bundle in `fuzz/seeds/`) and kept in `--work/<target>/corpus` between runs.
libFuzzer stops at the first finding and saves it as `crash-*`, `timeout-*` (an input that took
over 10 s) or `oom-*` (over 2 GiB resident) under `--work/<target>/`. Prints and writes one
record per target: executions, seconds, corpus size, crashes, hangs, out-of-memory.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

FUZZ = Path(__file__).resolve().parent
ROOT = FUZZ.parent
TARGETS = (
    "safetensors",
    "gguf",
    "config",
    "quantization_config",
    "shard_index",
    "tokenizer",
    "manifest",
)
TIMEOUT_S = 10
SHARD = "model-00001-of-00001.safetensors"  # the one shard the shard_index target holds
RSS_LIMIT_MB = 2048


def seed(target: str, corpus: Path) -> None:
    """Write the seed inputs of `target` into `corpus` (once)."""
    corpus.mkdir(parents=True, exist_ok=True)
    if any(corpus.iterdir()):
        return
    import torch

    if target == "safetensors":
        from safetensors.torch import save

        tensors = {
            "f32": torch.randn(2, 3),
            "bf16": torch.randn(4).bfloat16(),
            "i8": torch.arange(6, dtype=torch.int8).view(3, 2),
            "u8": torch.zeros(0, 5, dtype=torch.uint8),
        }
        (corpus / "four-dtypes").write_bytes(save(tensors, metadata={"format": "pt"}))
        (corpus / "one").write_bytes(save({"x": torch.ones(1)}))
    elif target == "config":
        from edgemtp.model.synth import preset_config

        for preset in ("tiny", "tiny-assistant", "e2b", "e2b-assistant"):
            text = json.dumps(preset_config(preset), indent=1).encode()
            (corpus / preset).write_bytes(text)
    elif target == "quantization_config":
        from edgemtp.quantize.checkpoint import Settings, compressed_tensors_config

        for name, settings in (
            ("w4a16", Settings("w4a16")),
            ("asym", Settings("w4a16", 64, False)),
        ):
            text = json.dumps({"quantization_config": compressed_tensors_config(settings, [])})
            (corpus / name).write_text(text)
    elif target == "shard_index":
        index = {"metadata": {"total_size": 11}, "weight_map": {"a": SHARD, "b": SHARD}}
        (corpus / "two").write_text(json.dumps(index))
    elif target == "tokenizer":
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        words = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
        trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=words)
        tok.train_from_iterator(["Hello world, a small corpus.", "user model turn"], trainer)
        (corpus / "bpe").write_text(tok.to_str())
    elif target == "manifest":
        (corpus / "tiny-executorch").write_bytes((FUZZ / "seeds" / "manifest.json").read_bytes())
    else:
        sys.path.insert(0, str(ROOT / "tests"))
        from test_gguf_import import BASE, build_hf, write_gguf

        with tempfile.TemporaryDirectory() as tmp:
            build_hf(Path(tmp) / "hf", hidden_size=64, intermediate_size=64, **BASE)
            write_gguf(Path(tmp) / "hf", corpus / "tiny.gguf")


def child(target: str, args: list[str]) -> None:
    """The fuzzing process: instrument edgemtp and the GGUF reader, then hand over to
    libFuzzer (which exits the process on a finding)."""
    import atheris
    import numpy  # noqa: F401  (big dependencies stay uninstrumented)
    import torch  # noqa: F401

    with atheris.instrument_imports(include=["edgemtp", "gguf", "jsonschema", "targets"]):
        sys.path.insert(0, str(FUZZ))
        import targets

    def one_input(data: bytes) -> None:
        targets.check(target, data)

    atheris.Setup([sys.argv[0], *args], one_input)
    atheris.Fuzz()


def fuzz(target: str, seconds: int, work: Path) -> dict[str, Any]:
    folder = work / target
    corpus = folder / "corpus"
    seed(target, corpus)
    earlier = folder / "earlier"  # findings of previous runs: kept, not counted again
    for old in folder.glob("*-*"):
        if old.is_file():
            earlier.mkdir(exist_ok=True)
            old.rename(earlier / old.name)
    flags = [
        f"-max_total_time={seconds}",
        f"-timeout={TIMEOUT_S}",
        f"-rss_limit_mb={RSS_LIMIT_MB}",
        "-max_len=65536",
        f"-artifact_prefix={folder}/",
        "-print_final_stats=1",
        str(corpus),
    ]
    cmd = [sys.executable, __file__, "--child", target, "--", *flags]
    print(f"fuzzing {target} for {seconds} s ...", file=sys.stderr, flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 600)
    log = done.stdout + done.stderr
    (folder / "last.log").write_text(log)
    runs = re.findall(r"stat::number_of_executed_units:\s*(\d+)", log)
    artifacts = sorted(p.name for p in folder.iterdir() if p.is_file() and "-" in p.name)
    findings = [a for a in artifacts if a.split("-")[0] in ("crash", "timeout", "oom", "leak")]
    record = {
        "target": target,
        "seconds": seconds,
        "executions": int(runs[-1]) if runs else 0,
        "corpus_files": sum(1 for _ in corpus.iterdir()),
        "crashes": sum(a.startswith(("crash-", "leak-")) for a in findings),
        "hangs": sum(a.startswith("timeout-") for a in findings),
        "out_of_memory": sum(a.startswith("oom-") for a in findings),
        "findings": [str(folder / a) for a in findings],
        "exit_code": done.returncode,
    }
    if done.returncode and not findings:
        record["error_tail"] = log.strip().splitlines()[-15:]
    return record


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[4:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("targets", nargs="*", help=f"some of {', '.join(TARGETS)} (all)")
    parser.add_argument("--seconds", type=int, default=600)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "edgemtp-fuzz")
    parser.add_argument("--out", type=Path, help="write the records as JSON here")
    args = parser.parse_args()
    unknown = set(args.targets) - set(TARGETS)
    if unknown:
        parser.error(f"unknown targets {sorted(unknown)}: choose from {', '.join(TARGETS)}")
    records = [fuzz(t, args.seconds, args.work) for t in args.targets or TARGETS]
    for r in records:
        print(
            f"{r['target']:12s} {r['executions']:>9d} executions in {r['seconds']} s, "
            f"corpus {r['corpus_files']}, crashes {r['crashes']}, hangs {r['hangs']}, "
            f"out of memory {r['out_of_memory']}"
            + "".join(f"\n  finding: {f}" for f in r["findings"])
            + "".join(f"\n  {line}" for line in r.get("error_tail", []))
        )
    if args.out:
        result = {
            "command": "python " + " ".join(sys.argv),
            "date": datetime.date.today().isoformat(),
            "records": records,
        }
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    bad = any(r["findings"] or r["exit_code"] or not r["executions"] for r in records)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
