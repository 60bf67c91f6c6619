"""The offload side's gather alone: random rows of an E4B-shaped table, whole row vs parts,
one thread vs several, 4 KiB pages vs transparent huge pages.

    python bench/cpu/bench_gather.py --out bench/cpu/results/<run>

Tables (same bytes, same ids): `memfd` is the node table as ray-ple holds it (a sealed memfd
mapped read-only, `want_huge_pages` applied: huge pages only where the host's shmem THP
setting allows); `anon` and `anon_huge` are anonymous memory without and with
`MADV_HUGEPAGE` (the THP a host with `shmem_enabled: advise` would give the node table).
Per (table, T, layout, threads, method): median and p90 of `reps` whole steps (every part)
into a slot, in us and GB/s, and each part's median; every step's rows are checked. Parts
are gathered two ways, interleaved rep by rep: `units` (the shipped `np.take` over the table
viewed as units) and `fancy` (fancy indexing of a column view, the gather before). A
benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import time
from pathlib import Path

import numpy as np

from ray_ple.offload import gather as gather_module
from ray_ple.offload.gather import RowGatherer
from ray_ple.offload.table_segment import TableSegment
from ray_ple.offload.table_store import want_huge_pages
from ray_ple.protocol.geometry import split_layers

MIN_UNIT = gather_module._MIN_UNIT


def _huge_kb() -> int:
    """AnonHugePages + ShmemPmdMapped of this process (kB), from /proc/self/smaps_rollup."""
    total = 0
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith(("AnonHugePages:", "ShmemPmdMapped:")):
            total += int(line.split()[1])
    return total


def tables(rows: int, row_bytes: int, seed: int,
           names: list[str]) -> dict[str, tuple[np.ndarray, object]]:
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 255, (rows, row_bytes), dtype=np.uint8)
    out: dict[str, tuple[np.ndarray, object]] = {}
    if "memfd" in names:
        seg = TableSegment.create("table", rows * row_bytes)
        want_huge_pages(seg)
        np.ndarray((rows, row_bytes), np.uint8, seg.map)[:] = src
        out["memfd"] = (np.ndarray((rows, row_bytes), np.uint8, seg.map), seg)
    for name, huge in (("anon", False), ("anon_huge", True)):
        if name not in names:
            continue
        m = mmap.mmap(-1, rows * row_bytes)
        m.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
        a = np.ndarray((rows, row_bytes), np.uint8, m)
        a[:] = src
        out[name] = (a, m)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rows", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=42)
    ap.add_argument("--ple-dim", type=int, default=256)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256, 1024])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--methods", nargs="+", default=["units", "fancy"],
                    help="parts by unit take (shipped) and by fancy indexing (before)")
    ap.add_argument("--tables", nargs="+", default=["memfd", "anon", "anon_huge"])
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    d_bytes = args.ple_dim * 2
    row_bytes = args.layers * d_bytes
    held = tables(args.rows, row_bytes, 0, args.tables)
    shmem = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
    meta = {"rows": args.rows, "row_bytes": row_bytes, "cpus": os.cpu_count(),
            "huge_kb_after_fill": _huge_kb(),
            "shmem_enabled": shmem.read_text().strip() if shmem.exists() else None}
    results = []
    rng = np.random.default_rng(1)
    for name, (table, _) in held.items():
        for threads in args.threads:
            g = RowGatherer(table, max(args.tokens), threads)
            for t in args.tokens:
                slot = np.empty((t, row_bytes), np.uint8)
                for layout, parts in (("whole", (args.layers,)),
                                      ("parts_auto", split_layers(args.layers, "auto"))):
                    outs, cols, first = [], [], 0
                    for k in parts:
                        outs.append(slot[:, first * d_bytes:(first + k) * d_bytes].copy())
                        cols.append(first * d_bytes)
                        first += k
                    methods = args.methods if layout != "whole" else ["units"]
                    times = {m: [] for m in methods}  # per rep: each part's us
                    for r in range(args.reps):
                        k = r % len(methods)
                        for m in methods[k:] + methods[:k]:  # interleaved, rotating the order
                            ids = rng.integers(0, args.rows, t).astype(np.int32)  # cold rows
                            gather_module._MIN_UNIT = MIN_UNIT if m != "fancy" else 1 << 62
                            per = []
                            for p, (o, c) in enumerate(zip(outs, cols)):
                                t0 = time.perf_counter_ns()
                                g(ids, o, c, p == 0)
                                per.append(time.perf_counter_ns() - t0)
                            times[m].append(per)
                            got = np.concatenate(outs, axis=1)
                            bad = int((got != table[ids]).any(axis=1).sum())
                            assert bad == 0, (m, layout, t, bad)
                    gather_module._MIN_UNIT = MIN_UNIT
                    for m, per in times.items():
                        us = np.array(per) / 1e3
                        step = us.sum(axis=1)
                        med = float(np.median(step))
                        results.append({
                            "table": name, "threads": threads, "T": t, "layout": layout,
                            "method": m, "parts": len(parts), "median_us": round(med, 1),
                            "p90_us": round(float(np.percentile(step, 90)), 1),
                            "part_median_us": [round(float(x), 1) for x in np.median(us, 0)],
                            "GBps": round(t * row_bytes / med / 1e3, 2), "bad_rows": 0})
                        print(json.dumps(results[-1]), flush=True)
            g.close()
    (args.out / "gather.json").write_text(json.dumps({"meta": meta, "results": results},
                                                     indent=1))
    for _, h in held.values():
        h.close()


if __name__ == "__main__":
    main()
