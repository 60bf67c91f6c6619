"""The worker's post alone: what `WorkerEnd.begin` + `must_ring` cost the host per step.

The post sits between the engine's read of its sampled ids and the launch of the forward, so
on a GPU every microsecond of it is a microsecond of the step (`bench_model.py`'s
`host_post_us`). Measured on a real pair segment in shared memory with the real
`WorkerEnd`; the offload side's part of each step (every slot's `published`, then the
consumer's `released`) is written straight into its words, as tests/test_transaction_rules.py
does. Per slot count P and token count T, `post_ns`: the best of `--repeat` runs of
`--number` steps, less the same loop's cost of the offload side's writes (so the post plus
`end_step`'s phase check and the loop's call); the `--modes` figures time the post alone.

`--against REV` measures REV's code too (a temporary `git worktree`), the two interleaved
over `--rounds` rounds in fresh processes, order alternating, and prints the ratio per case.

`--modes` adds per-post medians (`--single` posts, each timed alone) under the conditions a
real step adds around the post, one at a time: `warm` (back to back, as above), `spinner`
(a forked process spins on the block's `posted` word, as an offload side with
`offload_spin_us` does), `cold` (`--evict-mib` of memory read between posts, as a
forward's working set evicts the post's code and data), `dirty` (the same memory written:
the post's misses then also wait for the write-back of dirty lines, as beside a process
that streams writes).

    python bench/cpu/bench_post.py --against HEAD~1 --out bench/cpu/results/<run>

A benchmark, not a test: nothing about time is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import time
import timeit
from collections.abc import Callable
from pathlib import Path

import against

CASES = ((1, 1), (7, 1), (14, 1), (7, 64), (14, 64))  # (slots P, tokens T)


MODES = ("warm", "spinner", "cold", "dirty")


def measure(number: int, repeat: int, modes: tuple[str, ...] = (), single: int = 300,
            evict_mib: int = 64) -> list[dict[str, float]]:
    """Runs in the code tree on sys.path[0]: ns per post for every case."""
    return [{"P": p, "T": t, **_post_ns(p, t, number, repeat, modes, single, evict_mib)}
            for p, t in CASES]


def _post_ns(p: int, t: int, number: int, repeat: int, modes: tuple[str, ...], single: int,
             evict_mib: int) -> dict[str, int]:
    import numpy as np

    from ray_ple.config import PleDeadlines
    from ray_ple.protocol.layout import SLOT_STRIDE, ControlBlock, PairLayout, State
    from ray_ple.protocol.shm import SharedSegment
    from ray_ple.protocol.transaction import WorkerEnd

    layout = PairLayout.compute(8192, (3 * 512,) * p)
    seg = SharedSegment.create("bench-post", layout.size)
    try:
        block = ControlBlock(seg, layout)
        block.write_header(seg.token, "0" * 64)
        block.set_state(State.READY)
        worker = WorkerEnd(block, 0, PleDeadlines(), tuple(f"t#{i}" for i in range(p)))
        published = np.ndarray((p,), np.uint64, seg.map, layout.published_offsets[0],
                               strides=(SLOT_STRIDE,))
        ids = np.arange(t, dtype=np.int32)

        def offload_side(s: int) -> None:
            published[:] = s
            block.released = s

        def step() -> None:
            s = worker.begin(ids)
            worker.must_ring()
            offload_side(s)
            worker.end_step(s)

        whole = min(timeit.repeat(step, number=number, repeat=repeat)) / number
        side = min(timeit.repeat(lambda: offload_side(worker.step), number=number,
                                 repeat=repeat)) / number
        out = {"post_ns": round((whole - side) * 1e9)}
        clock = time.perf_counter_ns
        bracket = statistics.median(-clock() + clock() for _ in range(1000))
        evict = np.ones(evict_mib << 17, np.int64)  # written: real pages, not the zero page

        def timed_post(between: Callable[[], object]) -> float:
            between()
            t0 = clock()
            s = worker.begin(ids)
            worker.must_ring()
            took = clock() - t0
            offload_side(s)
            worker.end_step(s)
            return took

        for mode in modes:
            spinner = None
            try:
                spinner = _fork_spinner(block) if mode == "spinner" else None
                between = {"cold": evict.sum, "dirty": lambda: np.add(evict, 1, out=evict)
                           }.get(mode, lambda: None)
                took = [timed_post(between) for _ in range(single)]
            finally:
                if spinner is not None:
                    os.kill(spinner, signal.SIGKILL)
                    os.waitpid(spinner, 0)
            out[f"{mode}_median_ns"] = round(statistics.median(took) - bracket)
        return out
    finally:
        seg.close()


def _fork_spinner(block) -> int:
    """A child that reads `posted` in a loop, as a spinning offload side does, until killed
    (by this process, or by the kernel when this process dies: PR_SET_PDEATHSIG)."""
    import ctypes

    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child never returns
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
            if os.getppid() != parent:
                os._exit(0)  # the parent died before the prctl
            while True:
                _ = block.posted
                time.perf_counter()
        finally:
            os._exit(0)
    time.sleep(0.05)  # the child is spinning before the first post
    return pid


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--against", help="a git revision to measure side by side")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--number", type=int, default=5000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--modes", default="", help=f"comma list of {', '.join(MODES)}: per-post "
                    "medians under each condition")
    ap.add_argument("--single", type=int, default=300, help="posts per --modes figure")
    ap.add_argument("--evict-mib", type=int, default=64, help="memory read (cold) or written "
                    "(dirty) between posts")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    modes = tuple(m for m in a.modes.split(",") if m)
    if bad := set(modes) - set(MODES):
        ap.error(f"--modes: unknown {sorted(bad)}; known: {', '.join(MODES)}")
    rows: list[dict] = []
    with against.trees(a.against) as trees:
        for r in range(a.rounds):
            for name in against.in_order(list(trees), r):
                for row in against.measure_in(trees[name], "bench_post", (
                        f"measure({a.number}, {a.repeat}, {modes!r}, {a.single}, "
                        f"{a.evict_mib})")):
                    rows.append({"code": name, "round": r, **row})
                    print(json.dumps(rows[-1]), flush=True)
    for key in ("post_ns", *(f"{m}_median_ns" for m in modes)):
        print(f"\nmedian {key} (over rounds)")
        for p, t in CASES:
            med = {n: statistics.median(x[key] for x in rows
                                        if x["code"] == n and (x["P"], x["T"]) == (p, t))
                   for n in trees}
            ratio = f"  this/{a.against} {med['this'] / med[a.against]:.2f}" if a.against else ""
            print(f"P={p:>2} T={t:>2}: " + "  ".join(f"{n} {v:,.0f}" for n, v in med.items())
                  + ratio)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "post.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))


if __name__ == "__main__":
    main()
