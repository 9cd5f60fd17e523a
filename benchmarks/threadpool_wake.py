"""What a hand-off to ExecuTorch's thread pool costs after the pool has been idle a while.

    python benchmarks/threadpool_wake.py [--threads 2] [--gaps 0,5,20,...,3000] [--rounds 5]

The pool XNNPACK and edgemtp's kernels run on (`executorch::extension::threadpool`, pthreadpool
inside) lets its workers spin only briefly after a job, then sleep. A decode step hands work to
it some hundred times with a delegate call or a portable operator in between; when that gap
outlasts the spin, the next hand-off waits for a sleeping worker. This times one empty two-item
job (pthreadpool_parallelize_1d over libc's `free` on a null pointer: no work, only the hand-off
and the wait for every worker to check in) after the calling thread has busy-waited `gap` µs
since the previous job (`attention_forms.busy`). Medians and 90th percentiles of `--rounds`
rounds of 200 jobs per gap, the gaps interleaved; writes OUT/threadpool_wake.{json,md}.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from pathlib import Path

from attention_forms import busy
from harness import RESULTS, command_line, machine, write_json, write_report

JOBS = 200


def pool_job():
    """One empty job on ExecuTorch's pool, as a zero-argument callable."""
    import executorch

    lib = ctypes.CDLL(str(Path(executorch.__path__[0]) / "lib" / "libexecutorch_threadpool.so"))
    get_pool = lib._ZN10executorch9extension10threadpool15get_pthreadpoolEv  # get_pthreadpool()
    get_pool.restype = ctypes.c_void_p
    parallelize = lib.pthreadpool_parallelize_1d
    parallelize.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_size_t, ctypes.c_uint32]
    task = ctypes.cast(ctypes.CDLL(None).free, ctypes.c_void_p)  # free(NULL, i): a no-op task
    pool = get_pool()
    return lambda: parallelize(pool, task, None, 2, 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gaps", default="0,5,20,50,100,500,1000,3000")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    from executorch.extension.pybindings import portable_lib

    portable_lib._unsafe_reset_threadpool(args.threads)
    job = pool_job()
    clock = time.perf_counter_ns
    gaps = [int(g) for g in args.gaps.split(",")]
    waits: dict[int, list[float]] = {gap: [] for gap in gaps}
    for _ in range(args.rounds):  # the gaps interleaved, so that the machine's drift hits all
        for gap in gaps:
            for _ in range(JOBS):
                job()
                busy(gap)
                start = clock()
                job()
                waits[gap].append((clock() - start) / 1000)
    rows = []
    for gap in gaps:
        w = sorted(waits[gap])
        rows.append(
            {"gap_us": gap, "median_us": statistics.median(w), "p90_us": w[len(w) * 9 // 10]}
        )
        print(f"idle {gap:5d} µs -> hand-off {rows[-1]['median_us']:6.1f} µs", flush=True)
    command = command_line("threadpool_wake.py")
    result = {"command": command, "machine": machine(args.threads), "rows": rows}
    lines = [
        f"`{command}` ({time.strftime('%Y-%m-%d %H:%M')}; {result['machine']['cpu']}, "
        f"{args.threads} threads; {args.rounds} rounds of {JOBS} empty jobs per gap).",
        "",
        "| idle before the job (µs) | hand-off, median (µs) | 90th percentile (µs) |",
        "|---:|---:|---:|",
        *(f"| {r['gap_us']} | {r['median_us']:.1f} | {r['p90_us']:.1f} |" for r in rows),
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "threadpool_wake.json", result, indent=2)
    write_report(args.out / "threadpool_wake", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
