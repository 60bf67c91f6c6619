"""What one decode step of the pair costs each side in CPU time, for this code and another.

On a machine whose cores every process of a served engine shares (the 2-core VMs of
bench/cpu/README.md), CPU time spent by either side of the pair is time the engine waits
for: the worker's bracket (post, doorbell, pull, release) sits on the worker's core, and
the offload actor's wake-up, gather and publish sit on the core of the engine core and Serve.
`bench_serve.py` shows the sum of both in the served step, too noisily to tell a 10 us
change; this times them alone.

The project's `OffloadActor` runs in one process (outside Ray) and its `WorkerPair` with the
CPU transport in another, bound to one core as vLLM-CPU binds its worker, over real shared
memory. Each step sleeps `--gap-ms` (so the offload side is asleep on its doorbell when the
post comes, as between decode steps), reads `--evict-mib` of memory (a forward's working
set, which leaves the pair's code and data cold), then runs the real bracket around a
"forward" (`--forward-mib` read) that ends in the pull, and checks the row. Figures: the
offload process's CPU per step (all its threads, from its `schedstat`), and the worker's
CPU inside the bracket (its thread's CPU clock, the forward's reads excluded), median over
steps. `--against REV` runs REV's code too (a temporary `git worktree`), interleaved over
`--rounds` rounds in fresh processes, order alternating.

    python bench/cpu/bench_step_cpu.py --against HEAD~1 --out bench/cpu/results/<run>

A benchmark, not a test: nothing about time is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

import against


def _offload_main(spec: dict, conn) -> None:  # noqa: ANN001 - a Pipe end
    from ray_ple.offload.actor import OffloadActor

    actor = OffloadActor(spec)
    conn.send(actor.setup())
    conn.recv()  # "stop"
    actor.close()


def _cpu_ns(pid: int) -> int:
    """CPU time of every thread of `pid` (ns, the scheduler's own count)."""
    return sum(int(Path(f"/proc/{pid}/task/{t}/schedstat").read_text().split()[0])
               for t in os.listdir(f"/proc/{pid}/task"))


def _worker_main(handle: dict, geometry: dict, table_path: str, args: dict, conn) -> None:  # noqa: ANN001
    import time

    import numpy as np
    import torch

    from ray_ple.config import PleDeadlines
    from ray_ple.protocol.geometry import PleGeometry
    from ray_ple.protocol.handles import PairHandle
    from ray_ple.worker.pair import WorkerPair

    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # bound, as vLLM-CPU binds it
    torch.set_num_threads(1)
    geo = PleGeometry.model_validate(geometry)
    table = np.load(table_path)
    pair = WorkerPair.attach(PairHandle.model_validate(handle), geo, rank=0, transport="cpu",
                             deadlines=PleDeadlines(step_s=10.0), heartbeat_s=0.25)
    (slot,) = geo.slots()
    out = torch.empty((1, slot.row_bytes // 2), dtype=torch.bfloat16)
    evict = np.ones(args["evict_mib"] << 17, np.int64)
    forward = np.ones(max(1, args["forward_mib"]) << 17, np.int64)
    rng = np.random.default_rng(0)
    clock = time.thread_time_ns
    conn.send("ready")
    conn.recv()  # the parent has read the offload side's CPU clock
    bracket, bad = [], 0
    for _ in range(args["steps"]):
        ids = rng.integers(0, table.shape[0], size=1).astype(np.int32)
        time.sleep(args["gap_ms"] * 1e-3)
        evict.sum()
        t0 = clock()
        with pair.step(ids):
            t1 = clock()
            forward.sum()
            t2 = clock()
            pair.pull(0, out)
            t3 = clock()
        t4 = clock()
        bracket.append((t1 - t0) + (t3 - t2) + (t4 - t3))
        bad += int((out.view(torch.uint8).numpy()[0] != table[ids[0]]).any())
    conn.send({"bracket_ns": bracket, "bad_rows": bad})
    pair.close()


def measure(args: dict) -> dict:
    """Runs in the code tree on sys.path[0]: one round's figures."""
    import multiprocessing as mp

    import numpy as np

    from tests.rig import spec_for, write_checkpoint  # the tree's own, as the other benches

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="bench-step-cpu-") as tmp:
        ckpt = Path(tmp) / "ckpt"
        np.save(ckpt.parent / "table.npy", write_checkpoint(ckpt, rows=8192, layers=8,
                                                            ple_dim=64))
        spec = spec_for(ckpt, max_tokens=64)
        off_end, off_child = ctx.Pipe()
        off = ctx.Process(target=_offload_main, args=(spec.model_dump(), off_child),
                          daemon=True)
        off.start()
        wproc = None
        try:
            handle = off_end.recv()
            w_end, w_child = ctx.Pipe()
            wproc = ctx.Process(target=_worker_main, daemon=True, args=(
                handle.model_dump(), spec.geometry.model_dump(),
                str(ckpt.parent / "table.npy"), args, w_child))
            wproc.start()
            w_end.recv()
            c0 = _cpu_ns(off.pid)
            w_end.send("go")
            res = w_end.recv()
            offload_ns = _cpu_ns(off.pid) - c0
            off_end.send("stop")
        finally:
            for p in (wproc, off):
                if p is not None:
                    p.join(10)
                    if p.is_alive():
                        p.kill()
                        p.join()
    skip = min(50, args["steps"] // 10)  # warm-up steps
    return {"offload_cpu_us_per_step": round(offload_ns / args["steps"] / 1e3, 2),
            "worker_bracket_cpu_us_median": round(
                statistics.median(res["bracket_ns"][skip:]) / 1e3, 2),
            "bad_rows": res["bad_rows"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--against", help="a git revision to measure side by side")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--gap-ms", type=float, default=1.0)
    ap.add_argument("--evict-mib", type=int, default=8)
    ap.add_argument("--forward-mib", type=int, default=2)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    args = {"steps": a.steps, "gap_ms": a.gap_ms, "evict_mib": a.evict_mib,
            "forward_mib": a.forward_mib}
    rows: list[dict] = []
    with against.trees(a.against) as trees:
        for r in range(a.rounds):
            for name in against.in_order(list(trees), r):
                rows.append({"code": name, "round": r, **args, **against.measure_in(
                    trees[name], "bench_step_cpu", f"measure({args!r})")})
                print(json.dumps(rows[-1]), flush=True)
    lines = []
    for key in ("offload_cpu_us_per_step", "worker_bracket_cpu_us_median"):
        med = {n: statistics.median(x[key] for x in rows if x["code"] == n) for n in trees}
        span = {n: (min(x[key] for x in rows if x["code"] == n),
                    max(x[key] for x in rows if x["code"] == n)) for n in trees}
        lines.append(f"{key}: " + "  ".join(f"{n} {v:.1f} [{span[n][0]:.1f}, {span[n][1]:.1f}]"
                                            for n, v in med.items())
                     + (f"  this/{a.against} {med['this'] / med[a.against]:.2f}"
                        if a.against else ""))
    lines.append(f"bad rows: {sum(x['bad_rows'] for x in rows)}")
    print("\n".join(lines))
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "step_cpu.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
        (a.out / "step_cpu.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
