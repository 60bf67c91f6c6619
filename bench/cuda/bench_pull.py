"""Side-by-side cost of the PLE lookup on one GPU, one process, one table, one run.

Variants (row = 35 x 256 bf16 = 17,920 B; the table has 262,144 rows = 4.7 GB):

    A        table resident on the GPU, `index_select`                      (the baseline)
    B        UVA zero-copy gather kernel from the page-locked host table
    C_loop   this project's pull: offload actor in another process, ids produced by the
             previous GPU step; release enqueued after the replay (the vLLM hook's order)
    C_ahead  ids known ahead (host), the next step posted as soon as `released` moves
    D        naive: host sync, CPU gather from the pageable table, pageable copy

Every variant runs the same consumer (a row-by-row check of every word, so the numbers are
also a correctness proof) and the same next-ids LCG. A, B, C* are CUDA graphs; each step is
one closed-loop decode step: wait for the previous step, read its ids on the host, post or
launch. The per-step wall time is what a decode engine sees; "added" is its median minus A's.
A second section times the slot copy alone (fresh from the writer, and re-read), and the
offload turnaround (post -> flag seen by the host).

Run from the repository root: `python -m bench.cuda.bench_pull --out <file>`.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import ray_ple.worker.ops  # noqa: F401 - registers ray_ple::pull
from bench.cuda.uva_gather import UvaGather
from ray_ple.protocol.shm import page_align
from ray_ple.worker.transport import cuda as cuda_transport
from ray_ple.worker.transport.cuda_host import check, driver, register_host
from tests.gpu import cuda_rig as rig

ROW_BYTES = rig.ROW_ELEMS * 2


def stats(stamps: list[float], warm: int) -> dict[str, float]:
    d = np.diff(np.asarray(stamps))[warm:] * 1e6
    return {"median_us": round(float(np.median(d)), 2),
            "p10_us": round(float(np.percentile(d, 10)), 2),
            "p90_us": round(float(np.percentile(d, 90)), 2),
            "p99_us": round(float(np.percentile(d, 99)), 2), "min_us": round(float(d.min()), 2),
            "steps": int(d.size)}


class GpuTable(torch.nn.Module):
    """A: rows gathered from a GPU-resident table."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = table

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.index_select(self.table, 0, ids)


class UvaTable(torch.nn.Module):
    """B: rows read by SM loads straight from the registered host table (zero copy)."""

    def __init__(self, table_dev: int, rows: int, device: int) -> None:
        super().__init__()
        self.table_dev, self.rows, self.kernels = table_dev, rows, UvaGather(device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = torch.empty((ids.shape[0], rig.ROW_ELEMS), dtype=torch.bfloat16, device=ids.device)
        ids32 = ids.to(torch.int32)
        self.kernels.launch(self.table_dev, ids32.data_ptr(), out.data_ptr(),
                                   ids.shape[0], ROW_BYTES, self.rows,
                                   torch.cuda.current_stream().cuda_stream)
        return out


class PlainGraph:
    """A/B: the same closed loop as `rig.GraphStep`, without a pair."""

    def __init__(self, model: torch.nn.Module, ids0: torch.Tensor) -> None:
        self.ids, self.err = ids0.clone(), torch.zeros((), dtype=torch.int64, device="cuda")
        self.host_ids = torch.empty(ids0.shape[0], dtype=torch.int64, pin_memory=True)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            model(self.ids)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            bad, nxt, _ = model(self.ids)
            self.err.add_(bad)
            self.ids.copy_(nxt)
            self.host_ids.copy_(nxt, non_blocking=True)
        self.err.zero_()
        self.ids.copy_(ids0)
        torch.cuda.synchronize()

    def run(self, n: int, stamps: list[float]) -> int:
        stream = torch.cuda.current_stream()
        for _ in range(n):
            stream.synchronize()
            stamps.append(time.perf_counter())
            _ = self.host_ids.numpy()  # the host reads the sampled ids, as the others do
            self.graph.replay()
        stream.synchronize()
        stamps.append(time.perf_counter())
        return int(self.err.item())


class AheadGraph:
    """C_ahead: ids come from the host; the graph pulls, then copies the posted ids in; the
    release follows the replay (the transport's, as every step's)."""

    def __init__(self, pair: Any, model: rig.StandIn, t: int) -> None:
        self.pair, self.model, self.t = pair, model, t
        self.staged = torch.zeros(t, dtype=torch.int64, pin_memory=True)
        self.ids = torch.zeros(t, dtype=torch.int64, device="cuda")
        self.err = torch.zeros((), dtype=torch.int64, device="cuda")
        self.graph = torch.cuda.CUDAGraph()
        with pair.local_forward(), torch.cuda.graph(self.graph):
            rows = model.ple(self.ids)
            self.ids.copy_(self.staged, non_blocking=True)  # after the wait: posted ids
            self.err.add_(rig.wrong_words(rows.view(torch.int32), self.ids, model.cols))
        torch.cuda.synchronize()

    def run(self, n: int, stamps: list[float], rng: np.random.Generator) -> int:
        pair, block = self.pair, self.pair.block
        host = self.staged.numpy()
        for _ in range(n):
            ids = rng.integers(0, self.model.rows, size=self.t, dtype=np.int32)
            deadline = time.perf_counter() + 30
            while block.released != pair.worker.step:  # the previous step is released
                if time.perf_counter() > deadline:
                    raise TimeoutError(f"step {pair.worker.step} not released in 30 s")
            stamps.append(time.perf_counter())
            host[:] = ids
            with pair.step(ids):
                self.graph.replay()
        torch.cuda.synchronize()
        stamps.append(time.perf_counter())
        return int(self.err.item())


class AheadPlain:
    """A_ahead: the same ids-from-host step as C_ahead, rows from the GPU table."""

    def __init__(self, model: rig.StandIn, t: int) -> None:
        self.model, self.t = model, t
        self.staged = torch.zeros(t, dtype=torch.int64, pin_memory=True)
        self.ids = torch.zeros(t, dtype=torch.int64, device="cuda")
        self.err = torch.zeros((), dtype=torch.int64, device="cuda")
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.ids.copy_(self.staged, non_blocking=True)
            rows = model.ple(self.ids)
            self.err.add_(rig.wrong_words(rows.view(torch.int32), self.ids, model.cols))
        torch.cuda.synchronize()

    def run(self, n: int, stamps: list[float], rng: np.random.Generator) -> int:
        host, stream = self.staged.numpy(), torch.cuda.current_stream()
        for _ in range(n):
            ids = rng.integers(0, self.model.rows, size=self.t, dtype=np.int64)
            stream.synchronize()
            stamps.append(time.perf_counter())
            host[:] = ids
            self.graph.replay()
        stream.synchronize()
        stamps.append(time.perf_counter())
        return int(self.err.item())


def c_launch_first(graph: rig.GraphStep, n: int, stamps: list[float],
                   parts: dict[str, list[float]] | None = None) -> int:
    """C_loop with the replay enqueued before the post (the graph waits on the flag anyway)."""
    pair = graph.engine.pair
    stream = torch.cuda.current_stream()
    for _ in range(n):
        stream.synchronize()
        t0 = time.perf_counter()
        stamps.append(t0)
        host = graph.host_ids.numpy()
        graph.graph.replay()
        t1 = time.perf_counter()
        with pair.step(host):
            t2 = time.perf_counter()
        t3 = time.perf_counter()
        if parts is not None:
            parts["launch"].append(t1 - t0)
            parts["post"].append(t2 - t1)
            parts["release_enqueue"].append(t3 - t2)
    stream.synchronize()
    stamps.append(time.perf_counter())
    return int(graph.err.item())


def c_breakdown(graph: rig.GraphStep, n: int, stamps: list[float],
                parts: dict[str, list[float]]) -> int:
    """C_loop (post first) with host stamps: post, launch, release enqueue, wait for GPU."""
    pair = graph.engine.pair
    stream = torch.cuda.current_stream()
    for _ in range(n):
        stream.synchronize()
        t0 = time.perf_counter()
        stamps.append(t0)
        host = graph.host_ids.numpy()
        with pair.step(host):
            t1 = time.perf_counter()
            graph.graph.replay()
            t2 = time.perf_counter()
        t3 = time.perf_counter()
        parts["post"].append(t1 - t0)
        parts["launch"].append(t2 - t1)
        parts["release_enqueue"].append(t3 - t2)
    stream.synchronize()
    stamps.append(time.perf_counter())
    return int(graph.err.item())


def d_loop(model: rig.StandIn, table_cpu: torch.Tensor, t: int, n: int,
           stamps: list[float], seed: int) -> int:
    """D: sync, read ids, CPU gather from the pageable table, pageable H2D, graph tail."""
    ids = torch.from_numpy(rig.first_ids(t, model.rows, seed)).cuda()
    rows = torch.empty((t, rig.ROW_ELEMS), dtype=torch.bfloat16, device="cuda")
    err = torch.zeros((), dtype=torch.int64, device="cuda")
    host_ids = torch.empty(t, dtype=torch.int64, pin_memory=True)
    host_ids.copy_(ids)

    class Tail(torch.nn.Module):
        def forward(self, i: torch.Tensor) -> torch.Tensor:
            return rows

    model.ple = Tail()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        model(ids)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        bad, nxt, _ = model(ids)
        err.add_(bad)
        ids.copy_(nxt)
        host_ids.copy_(nxt, non_blocking=True)
    err.zero_()
    torch.cuda.synchronize()
    stream = torch.cuda.current_stream()
    for _ in range(n):
        stream.synchronize()
        stamps.append(time.perf_counter())
        idx = torch.from_numpy(host_ids.numpy().copy())
        cpu_rows = torch.index_select(table_cpu, 0, idx)
        rows.view(torch.uint8).view(t, ROW_BYTES).copy_(cpu_rows)  # pageable -> device
        graph.replay()
    stream.synchronize()
    stamps.append(time.perf_counter())
    return int(err.item())


def copy_section(pair: Any, t: int, reps: int, rows: int,
                 rng: np.random.Generator) -> dict[str, Any]:
    """Copy time of the freshly written slot (event-timed) per mode, and offload turnaround."""
    tr, block, d = pair.transport, pair.block, driver()
    out = torch.empty((t, rig.ROW_ELEMS), dtype=torch.bfloat16, device="cuda")
    again = torch.empty_like(out)
    res: dict[str, Any] = {"tokens": t, "bytes": t * ROW_BYTES}
    stream = torch.cuda.current_stream().cuda_stream
    for mode in ("dma", "sm"):
        cuda_transport.COPY_MODE = mode
        fresh, reread, turn = [], [], []
        for _ in range(reps):
            ids = rng.integers(0, rows, size=t, dtype=np.int32)
            e0, e1, e2, e3 = (torch.cuda.Event(enable_timing=True) for _ in range(4))
            t0 = time.perf_counter()
            with pair.step(ids):
                while block.flags[0][0] != 1:
                    pass
                turn.append((time.perf_counter() - t0) * 1e6)
                e0.record()
                torch.ops.ray_ple.pull(out, rig.TABLE)  # flag already up: wait + copy only
                e1.record()
            e2.record()
            if mode == "sm":
                tr.kernels.launch_copy(tr._slot_dev[0], again.data_ptr(), t * ROW_BYTES, stream)
            else:
                check(d.cuMemcpyHtoDAsync(again.data_ptr(), tr._slot_host[0], t * ROW_BYTES,
                                          stream), "re-read")
            e3.record()
            torch.cuda.synchronize()
            fresh.append(e0.elapsed_time(e1) * 1e3)
            reread.append(e2.elapsed_time(e3) * 1e3)
            if not torch.equal(out.view(torch.int16), again.view(torch.int16)):
                raise AssertionError("re-read differs from the pulled rows")
        nb = t * ROW_BYTES
        res[mode] = {
            "fresh_us": round(float(np.median(fresh)), 2),
            "fresh_GBps": round(nb / np.median(fresh) / 1e3, 2),
            "reread_us": round(float(np.median(reread)), 2),
            "reread_GBps": round(nb / np.median(reread) / 1e3, 2),
            "turnaround_us": round(float(np.median(turn)), 2),
        }
    cuda_transport.COPY_MODE = "auto"
    return res


def bench_tokens(t: int, n: int, pair: Any, table_gpu: torch.Tensor, table_dev: int,
                 table_cpu: torch.Tensor, a_table_bytes: int, rows: int,
                 rng: np.random.Generator) -> dict[str, Any]:
    """Every variant at one token count, closed loop, same ids start, same consumer."""
    warm = min(50, n // 5)
    row: dict[str, Any] = {}
    ids0 = torch.from_numpy(rig.first_ids(t, rows, t)).cuda()
    dev = torch.cuda.current_device()

    def measure(name: str, fn: Any) -> None:
        stamps: list[float] = []
        wrong = fn(stamps)
        ple_bytes = t * ROW_BYTES + (a_table_bytes if name == "A" else 0)
        row[name] = {**stats(stamps, warm), "wrong_words": wrong, "ple_gpu_bytes": ple_bytes}
        print(json.dumps({"T": t, "variant": name, **row[name]}), flush=True)

    model_a = rig.StandIn(rows).cuda()
    model_a.ple = GpuTable(table_gpu)
    measure("A", lambda s: PlainGraph(model_a, ids0).run(n + warm, s))
    model_b = rig.StandIn(rows).cuda()
    model_b.ple = UvaTable(table_dev, rows, dev)
    measure("B", lambda s: PlainGraph(model_b, ids0).run(n + warm, s))
    for name, mode in (("C_loop", "auto"), ("C_loop_dma", "dma"), ("C_loop_sm", "sm")):
        cuda_transport.COPY_MODE = mode  # baked into the graph at its capture
        eng = rig.Engine(pair, rig.StandIn(rows).cuda(), t, rows, torch.device("cuda"), seed=t)
        measure(name, lambda s, e=eng: e.capture().run(n + warm, stamps=s))
    cuda_transport.COPY_MODE = "auto"
    parts: dict[str, dict[str, list[float]]] = {
        k: {"post": [], "launch": [], "release_enqueue": []} for k in ("post_first", "lf")}
    eng = rig.Engine(pair, rig.StandIn(rows).cuda(), t, rows, torch.device("cuda"), seed=t)
    measure("C_loop_parts", lambda s: c_breakdown(eng.capture(), n + warm, s,
                                                  parts["post_first"]))
    eng = rig.Engine(pair, rig.StandIn(rows).cuda(), t, rows, torch.device("cuda"), seed=t)
    measure("C_loop_lf", lambda s: c_launch_first(eng.capture(), n + warm, s, parts["lf"]))
    row["host_parts_us"] = {k: {p: round(float(np.median(v[p][warm:])) * 1e6, 2) for p in v}
                            for k, v in parts.items()}
    model_aa = rig.StandIn(rows).cuda()
    model_aa.ple = GpuTable(table_gpu)
    a_ahead = AheadPlain(model_aa, t)
    measure("A_ahead", lambda s: a_ahead.run(n + warm, s, rng))
    ahead = AheadGraph(pair, rig.StandIn(rows).cuda(), t)
    measure("C_ahead", lambda s: ahead.run(n + warm, s, rng))
    measure("D", lambda s: d_loop(rig.StandIn(rows).cuda(), table_cpu, t, min(n, 200) + warm,
                                  s, t))
    base = row["A"]["median_us"]
    for v in row.values():
        if "median_us" in v:
            v["added_vs_A_us"] = round(v["median_us"] - base, 2)
    row["C_ahead"]["added_vs_A_ahead_us"] = round(
        row["C_ahead"]["median_us"] - row["A_ahead"]["median_us"], 2)
    print(json.dumps({"T": t, "host_parts_us": row["host_parts_us"]}), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=262144)
    ap.add_argument("--tokens", default="1,8,64,256,8192")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--big-steps", type=int, default=30)
    ap.add_argument("--spin-us", type=float, default=5000)
    ap.add_argument("--work", type=Path, default=Path("/dev/shm/ray-ple-bench"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--offload-env", action="append", default=[], metavar="KEY=VALUE",
                    help="environment of the offload process only (e.g. GLIBC_TUNABLES)")
    a = ap.parse_args()
    tokens = [int(x) for x in a.tokens.split(",")]
    max_tokens = max(tokens)
    res: dict[str, Any] = {"args": {k: str(v) for k, v in vars(a).items()},
                           "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    t0 = time.perf_counter()
    ckpt = rig.write_pattern_checkpoint(a.work / "ckpt", a.rows)
    res["table_write_s"] = round(time.perf_counter() - t0, 2)
    geo = rig.geometry(a.rows, max_tokens)
    t0 = time.perf_counter()
    off_env = dict(kv.split("=", 1) for kv in a.offload_env)
    off = rig.OffloadProcess(ckpt.parent, geo, spin_us=a.spin_us, env=off_env)
    res["offload_setup_s"] = round(time.perf_counter() - t0, 2)
    try:
        pair = rig.attach(off.handle, geo, "cuda")
        res["pair_register_s"] = round(pair.transport.registration.seconds, 4)
        res["pair_segment_bytes"] = pair.block.segment.size
        # the table, three ways: GPU (A), registered host (B), pageable host (D)
        fd = os.open(ckpt, os.O_RDWR)
        size = os.fstat(fd).st_size
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        keep = np.frombuffer(mm, dtype=np.uint8)
        data_off = size - a.rows * ROW_BYTES
        host_np = keep[data_off:].reshape(a.rows, ROW_BYTES)
        m0 = torch.cuda.memory_allocated()
        table_gpu = torch.from_numpy(host_np).cuda().view(torch.bfloat16)
        res["A_gpu_bytes"] = torch.cuda.memory_allocated() - m0
        t0 = time.perf_counter()
        reg = register_host(int(keep.ctypes.data), page_align(size), keep,
                            what="whole PLE table (variant B)")
        res["B_register_s"] = round(time.perf_counter() - t0, 3)
        table_cpu = torch.from_numpy(host_np)
        rng = np.random.default_rng(0)
        res["rows"] = {}
        for t in tokens:
            n = a.steps if t <= 256 else a.big_steps
            res["rows"][str(t)] = bench_tokens(t, n, pair, table_gpu, reg.device_ptr + data_off,
                                               table_cpu, res["A_gpu_bytes"], a.rows, rng)
        res["copy"] = [copy_section(pair, t, 20 if t <= 256 else 8, a.rows, rng)
                       for t in tokens if t >= 8]
        for c in res["copy"]:
            print(json.dumps({"copy": c}), flush=True)
        res["offload_status"] = off.status()
        res["host_pinned_bytes"] = {"C_slots_segment": pair.block.segment.size,
                                    "B_table": page_align(size)}
    finally:
        off.close()
    a.out.write_text(json.dumps(res, indent=1))
    print_table(res)


def print_table(res: dict[str, Any]) -> None:
    variants = ["A", "B", "C_loop", "C_loop_dma", "C_loop_sm", "C_loop_lf",
                "A_ahead", "C_ahead", "D"]
    print("\nmedian step us (added vs A) | wrong words")
    print("T".rjust(5), *(v.rjust(16) for v in variants))
    for t, row in res["rows"].items():
        cells = [f"{row[v]['median_us']:.1f}({row[v]['added_vs_A_us']:+.1f})" if v in row else "-"
                 for v in variants]
        print(t.rjust(5), *(c.rjust(16) for c in cells),
              "wrong=" + str(sum(v["wrong_words"] for v in row.values() if "wrong_words" in v)))
    for c in res.get("copy", []):
        print(f"copy T={c['tokens']}: " + "  ".join(
            f"{m}: fresh {c[m]['fresh_GBps']} GB/s ({c[m]['fresh_us']} us), re-read "
            f"{c[m]['reread_GBps']} GB/s, turnaround {c[m]['turnaround_us']} us"
            for m in ("dma", "sm")))


if __name__ == "__main__":
    main()
