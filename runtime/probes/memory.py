"""This process's memory: peak and current resident set size, in MiB (2**20 bytes); the
machine's physical memory, in bytes.

The command line prints these MiB as "MB".
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

MIB = 2**20


def maxrss_to_mb(ru_maxrss: int, platform: str = sys.platform) -> float:
    """getrusage's ru_maxrss in MiB: macOS counts bytes, Linux and the BSDs kilobytes."""
    return ru_maxrss / MIB if platform == "darwin" else ru_maxrss / 1024


def peak_rss_mb() -> float | None:
    """The most this process has held resident since it started (the kernel's high-water mark).

    None where neither `resource` (not on Windows) nor psutil can tell.
    """
    try:
        import resource
    except ImportError:
        try:
            import psutil
        except ImportError:
            return None
        return getattr(psutil.Process().memory_info(), "peak_wset", 0) / MIB or None
    return maxrss_to_mb(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def rss_from_statm(text: str, page_size: int) -> float:
    """Resident MiB from a /proc/PID/statm line ("size resident shared ..." in pages)."""
    return int(text.split()[1]) * page_size / MIB


def current_rss_mb() -> float | None:
    """What this process holds resident now: /proc/self/statm on Linux, else psutil, else None."""
    try:
        return rss_from_statm(Path("/proc/self/statm").read_text(), os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, IndexError, AttributeError):  # no procfs; os.sysconf: Windows
        pass
    try:
        import psutil
    except ImportError:
        return None
    return psutil.Process().memory_info().rss / MIB


def physical_memory() -> int:
    """Bytes of RAM this machine has (sysconf on Linux and macOS, else psutil, else unbounded)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        pass
    try:
        import psutil
    except ImportError:
        return sys.maxsize
    return int(psutil.virtual_memory().total)
