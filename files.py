"""Writing folders whole: what a command leaves at `--out` is complete, or nothing."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def staged_folder(out: Path) -> Iterator[Path]:
    """A hidden temporary folder beside `out` to write into. When the block ends normally it
    replaces `out` (with the permissions of a normal folder); when it raises, or is interrupted,
    it is removed. Nothing half-written is ever at `out`."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        yield tmp
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's folder is private; what we write is not
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
