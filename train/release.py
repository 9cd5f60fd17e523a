"""Release a trained checkpoint (target or assistant) as it ships: bfloat16 weights, HF layout.

Training writes float32 (what resuming needs); a released checkpoint is half the size, in the
dtype Google ships Gemma 4 in. Integer tensors (the assistant's token ordering) stay as they are.
Written to a temporary sibling folder and renamed: nothing half-written at `dst`.

  python -m edgemtp.train.release SRC DST
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

from edgemtp.errors import EdgeMTPError
from edgemtp.model.safetensors_file import TensorEntry, write_tensors
from edgemtp.quantize.load import open_checkpoint

KEPT_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "training.json",
    "distill.json",
)
CODES = {torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32"}


def release(src: Path, dst: Path) -> None:
    src, dst = Path(src), Path(dst)
    if dst.exists():
        raise EdgeMTPError(f"{dst} already exists; remove it or choose another folder")
    source = open_checkpoint(src)
    tensors = {}
    for name in sorted(source.names()):
        t = source.tensor(name)
        tensors[name] = t.to(torch.bfloat16) if t.is_floating_point() else t
    for name, t in tensors.items():
        if t.dtype not in CODES:
            raise EdgeMTPError(f"{src}: {name} is {t.dtype}; a released checkpoint holds no such")
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        entries = [TensorEntry(n, CODES[t.dtype], tuple(t.shape)) for n, t in tensors.items()]

        def produce(entry: TensorEntry):
            t = tensors[entry.name].contiguous()
            yield (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()

        write_tensors(tmp, entries, produce)
        config = json.loads((src / "config.json").read_text())
        config["dtype"] = "bfloat16"
        if "text_config" in config:
            config["text_config"]["dtype"] = "bfloat16"
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for name in KEPT_FILES:
            if (src / name).is_file():
                shutil.copyfile(src / name, tmp / name)
        tmp.rename(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path, help="trained checkpoint folder (float32)")
    parser.add_argument("dst", type=Path, help="folder to write (must not exist)")
    args = parser.parse_args(argv)
    try:
        release(args.src, args.dst)
    except EdgeMTPError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
