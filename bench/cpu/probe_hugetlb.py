"""Probe (bench, not a test): does a hugetlb memfd make part 0's gather faster on this host?

Two sealed, read-only, populated memfds with the same E4B-shaped rows: 4 KiB pages (the node
table without a pool) and `MFD_HUGETLB` (2 MiB pages from the host's hugetlb pool, which
must hold the table: `vm.nr_hugepages` or a pod's `hugepages-2Mi`). Per T: median us of part
0's gather (one layer of every token, `np.take` of 512 B units), the two interleaved. With
`--evict-mb N` every gather first reads N MB elsewhere, as a step's other work does between
two gathers: the page tables' cache lines are then cold too, as in a served step.

    python bench/cpu/probe_hugetlb.py --rows 262144 --tokens 8 64 256 1024
"""

from __future__ import annotations

import argparse
import fcntl
import json
import mmap
import os
import time

import numpy as np

HUGE = 2 << 20
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL


def table(src: np.ndarray, huge: bool) -> np.ndarray:
    size = src.nbytes
    if huge:
        size = (size + HUGE - 1) // HUGE * HUGE
    fd = os.memfd_create("probe", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
                         | (os.MFD_HUGETLB if huge else 0))
    os.posix_fallocate(fd, 0, size)  # a short pool: an error here, not a SIGBUS below
    m = mmap.mmap(fd, size)
    np.ndarray(src.shape, np.uint8, m)[:] = src
    m.close()
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    m.madvise(getattr(mmap, "MADV_POPULATE_READ", 22))
    return np.ndarray(src.shape, np.uint8, m)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--layers", type=int, default=42)
    ap.add_argument("--unit", type=int, default=512)
    ap.add_argument("--tokens", type=int, nargs="+", default=[8, 64, 256, 1024])
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--evict-mb", type=int, default=0)
    args = ap.parse_args()
    src = np.random.default_rng(0).integers(0, 255, (args.rows, args.layers * args.unit),
                                            dtype=np.uint8)
    tables = {"pages_4k": table(src, False), "hugetlb_2m": table(src, True)}
    rng = np.random.default_rng(1)
    evict = np.ones(args.evict_mb << 17, np.uint64)  # 8-byte words
    for t in args.tokens:
        us: dict[str, list[float]] = {k: [] for k in tables}
        out = np.empty((t, 1), np.dtype((np.void, args.unit)))
        for r in range(args.reps):
            for name in (list(tables) if r % 2 else list(tables)[::-1]):
                flat = tables[name].reshape(-1).view(out.dtype)
                ids = rng.integers(0, args.rows, t)
                if evict.size:
                    int(evict.sum())
                t0 = time.perf_counter_ns()
                np.take(flat, (ids * args.layers)[:, None], out=out, mode="clip")
                us[name].append((time.perf_counter_ns() - t0) / 1e3)
                assert bytes(out[-1, 0]) == src[ids[-1], :args.unit].tobytes()
        print(json.dumps({"T": t, "rows": args.rows, "evict_mb": args.evict_mb} | {
            f"{k}_median_us": round(float(np.median(v)), 1) for k, v in us.items()}), flush=True)


if __name__ == "__main__":
    main()
