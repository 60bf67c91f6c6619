"""Two tensor-parallel ranks on ONE GPU, each with its own offload process, one host table.

Issue 6 asks for two GPUs on separate PCIe links; only one H200 is lent. This is the part one
GPU allows, and it is the worst case for link contention: two "rank" processes (each its own
CUDA context, as two TP workers would be) share one GPU and one PCIe link. Each rank is paired
with its own CPU-only offload process (`cuda_rig.OffloadProcess`, the project's
`OffloadActor`); both offload processes hold the node's one copy of the table (the table
store hands the second one the first one's segment fd), which is measured, not assumed:
`/proc/meminfo` Shmem before and after each offload setup, and the table inode's mappings,
Rss and Pss in every process.

Measured per rank, alone and with both ranks stepping at once, side by side in one run:

    loop    closed-loop decode steps replayed from a captured CUDA graph (`cuda_rig.GraphStep`)
    ahead   ids known ahead, whole step (release included) in the graph (`bench_pull.AheadGraph`)
    burst   back-to-back H2D copies of the pinned slot, event-timed (the link, no gather)
    fresh   the slot copy of a just-published step, event-timed (`bench_pull.copy_section`)

Every row of every step is verified on the GPU against the pattern (`cuda_rig.StandIn`).
Last, the isolation check: rank 1's offload process is SIGKILLed while both ranks step; rank
1's worker must fail closed (`ray_ple.protocol.fatal`: exit 86 within the heartbeat deadline) while
rank 0 keeps stepping with every row right.

    python -m bench.cuda.bench_two_ranks --out DIR                         # on the GPU
    python -m bench.cuda.bench_two_ranks --out DIR --transport cpu --rows 4096 \\
        --tokens 1,64 --steps 200 --big-steps 10                            # CPU smoke run

(from the repository root, as every bench).

The CPU transport runs the same protocol eagerly (no graphs, no burst/fresh copies).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.cuda import bench_pull
from ray_ple.protocol.fatal import EXIT_CODE
from ray_ple.protocol.handles import PairHandle
from tests.gpu import cuda_rig as rig
from tests.leftovers import shmem_bytes

ROW_BYTES = rig.ROW_ELEMS * 2
WORDS = ROW_BYTES // 4
MODES = ("loop", "ahead")


def wait_until(wall: float) -> None:
    """Sleep to a wall-clock start shared by both ranks (so 'both' phases overlap)."""
    delay = wall - time.time()
    if delay > 0:
        time.sleep(delay)


# the rank process ---------------------------------------------------------------------------
class CpuAhead:
    """`bench_pull.AheadGraph`'s CPU stand-in: host ids drawn ahead, eager forward."""

    def __init__(self, pair: Any, model: rig.StandIn, t: int) -> None:
        self.pair, self.model, self.t, self.err = pair, model, t, 0

    def run(self, n: int, stamps: list[float], rng: np.random.Generator) -> int:
        for _ in range(n):
            ids = rng.integers(0, self.model.rows, size=self.t, dtype=np.int64)
            stamps.append(time.perf_counter())
            with self.pair.step(ids.astype(np.int32)):
                bad, _, _ = self.model(torch.from_numpy(ids))
            self.err += int(bad)
        stamps.append(time.perf_counter())
        return self.err


class Rank:
    """One rank: its pair, its graphs per token count; answers the orchestrator's commands."""

    def __init__(self, pair: Any, rows: int, transport: str, index: int) -> None:
        self.pair, self.rows, self.index = pair, rows, index
        self.cuda = transport == "cuda"
        self.device = torch.device("cuda" if self.cuda else "cpu")
        self.loops: dict[int, Any] = {}
        self.aheads: dict[int, Any] = {}
        self.seen: dict[tuple[int, str], int] = {}  # cumulative wrong words already reported
        self.rng = np.random.default_rng(1000 + index)

    def prepare(self, t: int) -> dict[str, Any]:
        """Capture this token count's graphs (local forwards: no offload traffic)."""
        t0 = time.perf_counter()
        eng = rig.Engine(self.pair, rig.StandIn(self.rows).to(self.device), t, self.rows,
                         self.device, seed=7 * t + self.index)
        if self.cuda:
            self.loops[t] = eng.capture()
            self.aheads[t] = bench_pull.AheadGraph(self.pair, rig.StandIn(self.rows).cuda(), t)
        else:
            self.loops[t] = eng
            self.aheads[t] = CpuAhead(self.pair, rig.StandIn(self.rows), t)
        return {"prepared": t, "seconds": round(time.perf_counter() - t0, 3)}

    def _loop(self, t: int, n: int, stamps: list[float]) -> int:
        loop = self.loops[t]
        if self.cuda:
            return loop.run(n, stamps=stamps)
        wrong = 0
        for _ in range(n):
            stamps.append(time.perf_counter())
            wrong = loop.eager(1)
        stamps.append(time.perf_counter())
        return wrong

    def _run(self, t: int, mode: str, n: int, stamps: list[float]) -> int:
        """n steps; the wrong words they produced (counted on the device, every word)."""
        total = (self._loop(t, n, stamps) if mode == "loop"
                 else self.aheads[t].run(n, stamps, self.rng))
        wrong = total - self.seen.get((t, mode), 0)
        self.seen[(t, mode)] = total
        return wrong

    def steps(self, t: int, mode: str, n: int, warm: int, start_at: float,
              cap_s: float = 1e9) -> dict[str, Any]:
        """n steps (fewer if `cap_s` runs out: contention can stretch a phase), timed."""
        wait_until(start_at)
        w0, durations, done, wrong = time.time(), [], 0, 0
        while done < n and time.time() - w0 < cap_s:
            k, stamps = min(n - done, 250), []
            wrong += self._run(t, mode, k, stamps)
            durations.append(np.diff(stamps))  # per chunk: no gap between chunks counted
            done += k
        stamps = np.concatenate([[0.0], np.cumsum(np.concatenate(durations))]).tolist()
        return {**bench_pull.stats(stamps, warm), "wrong_words": wrong,
                "rows_verified": done * t, "words_verified": done * t * WORDS,
                "capped": done < n, "wall": [w0, time.time()]}

    def run_for(self, t: int, seconds: float, chunk: int, start_at: float) -> dict[str, Any]:
        """Closed-loop steps for `seconds` (isolation); per-chunk wall time and wrong words."""
        if t not in self.loops:
            self.prepare(t)
        wait_until(start_at)
        end, chunks, total_wrong = time.time() + seconds, [], 0
        while time.time() < end:
            stamps: list[float] = []
            wrong = self._run(t, "loop", chunk, stamps)
            total_wrong += wrong
            d = np.diff(stamps) * 1e6
            chunks.append({"wall_end": time.time(), "steps": chunk, "wrong_words": wrong,
                           "median_us": round(float(np.median(d)), 2),
                           "max_us": round(float(d.max()), 2)})
        steps = sum(c["steps"] for c in chunks)
        return {"chunks": chunks, "steps": steps, "rows_verified": steps * t,
                "wrong_words": total_wrong, "state": self.pair.block.state.name,
                "counters": list(self.pair.block.counters()[::2])}

    def burst(self, t: int, k: int, start_at: float) -> dict[str, Any]:
        """k back-to-back copies of T rows from the pinned slot (copy engine), event-timed."""
        from ray_ple.worker.transport.cuda_host import check, driver

        d, src = driver(), self.pair.transport._slot_host[0]
        nbytes = t * ROW_BYTES
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        stream = torch.cuda.current_stream()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        check(d.cuMemcpyHtoDAsync(dst.data_ptr(), src, nbytes, stream.cuda_stream), "warm-up")
        stream.synchronize()
        wait_until(start_at)
        w0 = time.time()
        e0.record()
        for _ in range(k):
            check(d.cuMemcpyHtoDAsync(dst.data_ptr(), src, nbytes, stream.cuda_stream), "burst")
        e1.record()
        e1.synchronize()
        ms = e0.elapsed_time(e1)
        return {"bytes": nbytes * k, "copies": k, "ms": round(ms, 3),
                "GBps": round(nbytes * k / ms / 1e6, 2), "wall": [w0, time.time()]}

    def fresh(self, t: int, reps: int, start_at: float) -> dict[str, Any]:
        wait_until(start_at)
        w0 = time.time()
        res = bench_pull.copy_section(self.pair, t, reps, self.rows, self.rng)
        return {**res, "wall": [w0, time.time()]}


def rank_main(index: int) -> None:
    """A rank process: attach its pair as a worker does, then serve commands (JSON lines)."""
    init = json.loads(sys.stdin.readline())
    transport = init["transport"]
    if transport == "cuda":
        import ray_ple.worker.ops  # noqa: F401 - registers ray_ple::pull
    geo = rig.geometry(init["rows"], init["max_tokens"])
    pair = rig.attach(PairHandle.model_validate(init["handle"]), geo, transport)
    rank = Rank(pair, init["rows"], transport, index)
    ready: dict[str, Any] = {"pid": os.getpid(), "transport": transport}
    if transport == "cuda":
        props = torch.cuda.get_device_properties(0)
        ready.update(gpu=props.name, pci_bus_id=getattr(props, "pci_bus_id", None),
                     segment_bytes=pair.block.segment.size)
    print(json.dumps(ready), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "close":
            pair.close()
            print(json.dumps({"closed": True}), flush=True)
            return
        out = getattr(rank, cmd["cmd"])(**cmd["args"])
        print(json.dumps(out), flush=True)


# the orchestrator -------------------------------------------------------------------------
class RankProc:
    """The orchestrator's end of one rank process (stdin/stdout JSON lines, log to a file)."""

    def __init__(self, index: int, handle: PairHandle, rows: int, max_tokens: int,
                 transport: str, log: Path) -> None:
        self.index = index
        self._log = open(log, "w")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.cuda.bench_two_ranks", "--rank-worker", str(index)],
            stdin=subprocess.PIPE, cwd=rig.REPO,
            stdout=subprocess.PIPE, stderr=self._log, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.send({"handle": handle.model_dump(mode="json"), "rows": rows,
                   "max_tokens": max_tokens, "transport": transport})
        self.ready = self.recv()

    def send(self, msg: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def recv(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"rank {self.index} exited with {self.proc.wait(10)}")
        return json.loads(line)

    def call(self, cmd: str, **args: Any) -> dict[str, Any]:
        self.send({"cmd": cmd, "args": args})
        return self.recv()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.call("close")
            self.proc.wait(30)
        self._log.close()


def together(ranks: list[RankProc], cmd: str, **args: Any) -> list[dict[str, Any]]:
    """The same command to several ranks at once (a shared wall-clock start), all replies."""
    args = {**args, "start_at": time.time() + 0.3} if "start_at" in args else args
    for r in ranks:
        r.send({"cmd": cmd, "args": args})
    return [r.recv() for r in ranks]


def overlap(walls: list[list[float]]) -> float:
    """Fraction of the longer window during which both ranks were running."""
    (a0, a1), (b0, b1) = walls
    return round(max(0.0, min(a1, b1) - max(a0, b0)) / max(a1 - a0, b1 - b0), 3)


def side_by_side(ranks: list[RankProc], cmd: str, **args: Any) -> dict[str, Any]:
    """Rank 0 alone, rank 1 alone, then both at once: the same work, one after the other."""
    res: dict[str, Any] = {}
    for r in ranks:
        res[f"alone{r.index}"] = together([r], cmd, start_at=0, **args)[0]
    both = together(ranks, cmd, start_at=0, **args)
    res["both"] = {f"rank{r.index}": b for r, b in zip(ranks, both, strict=True)}
    res["both"]["overlap"] = overlap([b["wall"] for b in both])
    return res


# host memory evidence -----------------------------------------------------------------------
_RANGE = re.compile(r"^[0-9a-f]+-[0-9a-f]+ ")


def inode_mapping(pid: int, inode: int) -> dict[str, Any]:
    """How `pid` maps `inode`: mappings, and (from smaps) mapped, Rss and Pss bytes."""
    res: dict[str, Any] = {"pid": pid, "mappings": 0, "size": 0, "rss": 0, "pss": 0}
    path = f"/proc/{pid}/smaps"
    if not os.path.exists(path):
        path, res["note"] = f"/proc/{pid}/maps", "no smaps: mappings only"
    hit = False
    with open(path) as f:
        for line in f:
            parts = line.split()
            if _RANGE.match(line):
                hit = len(parts) >= 5 and parts[4] == str(inode)
                res["mappings"] += hit
            elif hit and parts and parts[0] in ("Size:", "Rss:", "Pss:"):
                res[parts[0][:-1].lower()] += int(parts[1]) * 1024
    return res


def table_evidence(offs: list[rig.OffloadProcess], ranks: list[RankProc],
                   inode: int) -> dict[str, Any]:
    procs = {f"offload{i}": o.pid for i, o in enumerate(offs)}
    procs.update({f"rank{r.index}": r.proc.pid for r in ranks})
    return {"shmem_bytes": shmem_bytes(),
            **{k: inode_mapping(pid, inode) for k, pid in procs.items()}}


# the run ------------------------------------------------------------------------------------
def step_count(t: int, a: argparse.Namespace) -> int:
    return a.steps if t <= 256 else a.big_steps


def bench_tokens(ranks: list[RankProc], t: int, a: argparse.Namespace) -> dict[str, Any]:
    """Every measurement at one token count, alone and both, for both ranks."""
    n = step_count(t, a)
    warm = min(50, n // 5)
    row: dict[str, Any] = {"prepare": together(ranks, "prepare", t=t)}
    for mode in MODES:
        row[mode] = side_by_side(ranks, "steps", t=t, mode=mode, n=n + warm, warm=warm,
                                 cap_s=a.phase_cap_s)
        log_row(t, mode, row[mode])
    if a.transport == "cuda":
        if t >= 64:
            k = max(20, min(20000, int(a.burst_bytes // (t * ROW_BYTES))))
            row["burst"] = side_by_side(ranks, "burst", t=t, k=k)
            print(json.dumps({"T": t, "burst": row["burst"]}), flush=True)
        row["fresh"] = side_by_side(ranks, "fresh", t=t, reps=30 if t <= 256 else 8)
    return row


def log_row(t: int, mode: str, r: dict[str, Any]) -> None:
    cells = [f"{k}: {v['median_us']}/{v['p99_us']} us wrong={v['wrong_words']}"
             for k, v in (("alone0", r["alone0"]), ("alone1", r["alone1"]),
                          ("both0", r["both"]["rank0"]), ("both1", r["both"]["rank1"]))]
    print(f"T={t} {mode}: " + "; ".join(cells) + f"; overlap {r['both']['overlap']}",
          flush=True)


def isolation(ranks: list[RankProc], offs: list[rig.OffloadProcess],
              a: argparse.Namespace) -> dict[str, Any]:
    """SIGKILL rank 1's offload process mid-run; rank 1 must fail closed, rank 0 go on."""
    deadline = rig.deadlines().heartbeat_s
    seconds = a.kill_after_s + deadline + 5
    t = a.iso_tokens
    start_at = time.time() + 0.3
    for r in ranks:
        r.send({"cmd": "run_for", "args": {"t": t, "seconds": seconds, "chunk": a.iso_chunk,
                                           "start_at": start_at}})
    wait_until(start_at + a.kill_after_s)
    victim = offs[1].pid
    t_kill = time.time()
    os.kill(victim, signal.SIGKILL)
    r1 = ranks[1].proc
    try:
        rc = r1.wait(deadline + 10)
    except subprocess.TimeoutExpired:
        rc = None
    t_exit = time.time()
    offs[1].proc.wait(10)
    rank0 = ranks[0].recv()
    after = ranks[0].call("steps", t=t, mode="loop", n=a.iso_after, warm=0, start_at=0)
    verdicts = [json.loads(x) for x in Path(a.out, "rank1.log").read_text().splitlines()
                if '"verdict"' in x]
    before = [c for c in rank0["chunks"] if c["wall_end"] < t_kill]
    during = [c for c in rank0["chunks"] if t_kill <= c["wall_end"] <= t_exit]
    later = [c for c in rank0["chunks"] if c["wall_end"] > t_exit]
    res = {
        "tokens": t, "killed_pid": victim, "kill_after_s": a.kill_after_s,
        "start_wall": start_at, "kill_wall": t_kill, "rank1_exit_wall": t_exit,
        "heartbeat_deadline_s": deadline, "rank1_exit_code": rc,
        "rank1_exit_after_kill_s": round(t_exit - t_kill, 3) if rc is not None else None,
        "rank1_verdicts": verdicts,
        "rank1_failed_closed": rc == EXIT_CODE and bool(verdicts)
        and t_exit - t_kill <= deadline + 2,
        "rank0": {k: v for k, v in rank0.items() if k != "chunks"},
        "rank0_chunk_median_us": {
            name: round(float(np.median([c["median_us"] for c in cs])), 2) if cs else None
            for name, cs in (("before_kill", before), ("kill_to_rank1_exit", during),
                             ("after_rank1_exit", later))},
        "rank0_chunks": rank0["chunks"],
        "rank0_after": after,
        "offload0_status": offs[0].status(),
    }
    res["rank0_kept_correct"] = (rank0["wrong_words"] == 0 and after["wrong_words"] == 0
                                 and rank0["state"] == "READY" and bool(later))
    print(json.dumps({"isolation": {k: v for k, v in res.items() if k != "rank0_chunks"}}),
          flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rank-worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--transport", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--rows", type=int, default=262144)
    ap.add_argument("--tokens", default="1,64,256,8192")
    ap.add_argument("--steps", type=int, default=3000, help="steps per phase, T <= 256")
    ap.add_argument("--big-steps", type=int, default=60, help="steps per phase, T > 256")
    ap.add_argument("--phase-cap-s", type=float, default=15.0, help="longest steps phase")
    ap.add_argument("--burst-bytes", type=float, default=16e9, help="bytes per burst phase")
    ap.add_argument("--spin-us", type=float, default=5000)
    ap.add_argument("--iso-tokens", type=int, default=64)
    ap.add_argument("--iso-chunk", type=int, default=200, help="steps per isolation chunk")
    ap.add_argument("--iso-after", type=int, default=1000)
    ap.add_argument("--kill-after-s", type=float, default=3.0)
    ap.add_argument("--budget-s", type=float, default=300,
                    help="token counts not started within this (isolation kept) are skipped")
    ap.add_argument("--work", type=Path, default=Path("/dev/shm/ray-ple-two-ranks"))
    a = ap.parse_args()
    if a.rank_worker is not None:
        rank_main(a.rank_worker)
        return
    if a.out is None:
        ap.error("--out is required")
    try:
        run(a)
    finally:  # the pattern checkpoint is gigabytes of tmpfs: never leave it behind
        shutil.rmtree(a.work, ignore_errors=True)


def run(a: argparse.Namespace) -> None:
    t_start = time.time()
    a.out.mkdir(parents=True, exist_ok=True)
    tokens = [int(x) for x in a.tokens.split(",")]
    res: dict[str, Any] = {"args": {k: str(v) for k, v in vars(a).items()},
                           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "torch": torch.__version__, "rows": {}, "skipped_tokens": []}
    ckpt = rig.write_pattern_checkpoint(a.work / "ckpt", a.rows)
    geo = rig.geometry(a.rows, max(tokens + [a.iso_tokens]))
    table_bytes = a.rows * ROW_BYTES
    spin = a.spin_us if a.transport == "cuda" else 0.0
    offs: list[rig.OffloadProcess] = []
    ranks: list[RankProc] = []
    shmem = [shmem_bytes()]
    try:
        for i in range(2):
            t0 = time.perf_counter()
            offs.append(rig.OffloadProcess(ckpt.parent, geo, spin_us=spin,
                                           actor_name=f"two-ranks-offload-{i}"))
            shmem.append(shmem_bytes())
            res[f"offload{i}_setup_s"] = round(time.perf_counter() - t0, 2)
        status = [o.status() for o in offs]
        inode = status[0]["table_inodes"][0]
        pair_bytes = offs[0].handle.segment.size
        res["table"] = {
            "table_bytes": table_bytes, "pair_segment_bytes": pair_bytes,
            "table_inodes": [s["table_inodes"] for s in status],
            "fingerprints_equal": len({s["table_fingerprints"][0] for s in status}) == 1,
            "shmem_added_by_offload0": shmem[1] - shmem[0],
            "shmem_added_by_offload1": shmem[2] - shmem[1],
            "offload_cuda_evidence": [s["cuda_evidence"] for s in status],
            "offload_torch_imported": [s["torch_imported"] for s in status],
        }
        for i in range(2):
            ranks.append(RankProc(i, offs[i].handle, a.rows, geo.max_tokens, a.transport,
                                  a.out / f"rank{i}.log"))
        res["ranks_ready"] = [r.ready for r in ranks]
        res["table"]["after_setup"] = table_evidence(offs, ranks, inode)
        print(json.dumps({"table": res["table"]}), flush=True)
        for t in tokens:
            if time.time() - t_start > a.budget_s:
                res["skipped_tokens"].append(t)
                continue
            res["rows"][str(t)] = bench_tokens(ranks, t, a)
            write(a.out, res)
        res["table"]["after_steps"] = table_evidence(offs, ranks, inode)
        res["isolation"] = isolation(ranks, offs, a)
        res["table"]["after_isolation"] = table_evidence(offs[:1], ranks[:1], inode)
    finally:
        for r in ranks:
            try:
                r.close()
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
                res.setdefault("close_errors", []).append(f"rank {r.index}: {exc}")
        for o in offs:
            o.close()
        res["seconds"] = round(time.time() - t_start, 1)
        write(a.out, res)
    summary = summarize(res)
    (a.out / "two_ranks.txt").write_text(summary)
    print(summary)


def write(out: Path, res: dict[str, Any]) -> None:
    (out / "two_ranks.json").write_text(json.dumps(res, indent=1))


# the summary --------------------------------------------------------------------------------
def summarize(res: dict[str, Any]) -> str:
    """Human-readable tables of the JSON result."""
    lines = ["Two ranks on one GPU: per-step wall time, median / p99 us (alone -> both at once)",
             f"{'T':>5} {'mode':>6} {'rank':>4} {'alone':>17} {'both':>17} {'x med':>6} "
             f"{'timed':>6} {'rows verified':>14} {'wrong':>5}"]
    wrong_total = 0
    for t, row in res["rows"].items():
        for mode in MODES:
            r = row[mode]
            for i in (0, 1):
                al, bo = r[f"alone{i}"], r["both"][f"rank{i}"]
                wrong_total += al["wrong_words"] + bo["wrong_words"]
                lines.append(
                    f"{t:>5} {mode:>6} {i:>4} {al['median_us']:>8.1f} /{al['p99_us']:>7.1f} "
                    f"{bo['median_us']:>8.1f} /{bo['p99_us']:>7.1f} "
                    f"{bo['median_us'] / al['median_us']:>6.2f} {al['steps'] + bo['steps']:>6} "
                    f"{al['rows_verified'] + bo['rows_verified']:>14,} "
                    f"{al['wrong_words'] + bo['wrong_words']:>5}"
                    + (" capped" if al.get("capped") or bo.get("capped") else ""))
    lines.append(f"wrong words, all phases: {wrong_total}")
    bursts = [(t, row["burst"]) for t, row in res["rows"].items() if "burst" in row]
    if bursts:
        lines += ["", "H2D copy bandwidth, back-to-back slot copies (GB/s)",
                  f"{'T':>5} {'alone0':>8} {'alone1':>8} {'both0':>8} {'both1':>8} "
                  f"{'both sum':>9} {'overlap':>8}"]
        for t, b in bursts:
            b0, b1 = b["both"]["rank0"], b["both"]["rank1"]
            lines.append(f"{t:>5} {b['alone0']['GBps']:>8} {b['alone1']['GBps']:>8} "
                         f"{b0['GBps']:>8} {b1['GBps']:>8} {b0['GBps'] + b1['GBps']:>9.2f} "
                         f"{b['both']['overlap']:>8}")
    fresh = [(t, row["fresh"]) for t, row in res["rows"].items() if "fresh" in row]
    if fresh:
        lines += ["", "Fresh slot copy inside a step (copy engine): us (GB/s); turnaround us",
                  f"{'T':>5} {'alone0':>22} {'alone1':>22} {'both0':>22} {'both1':>22}"]
        for t, f in fresh:
            cells = [f[k]["dma"] for k in ("alone0", "alone1")]
            cells += [f["both"][k]["dma"] for k in ("rank0", "rank1")]
            lines.append(f"{t:>5} " + " ".join(
                f"{c['fresh_us']:>7} ({c['fresh_GBps']:>5}); {c['turnaround_us']:>5}"
                for c in cells))
    tb = res.get("table", {})
    if tb:
        lines += ["", f"Host table: {tb['table_bytes']:,} B; pair segment "
                  f"{tb['pair_segment_bytes']:,} B; inodes {tb['table_inodes']}",
                  f"  Shmem added by offload 0 setup: {tb['shmem_added_by_offload0']:,} B, "
                  f"by offload 1 setup: {tb['shmem_added_by_offload1']:,} B"]
        for when in ("after_setup", "after_steps"):
            ev = tb.get(when)
            if ev:
                lines.append(f"  {when}: " + "; ".join(
                    f"{k} maps={v['mappings']} rss={v['rss']:,} pss={v['pss']:,}"
                    for k, v in ev.items() if isinstance(v, dict)))
    iso = res.get("isolation")
    if iso:
        lines += ["", f"Isolation (T={iso['tokens']}): offload of rank 1 SIGKILLed "
                  f"{iso['kill_after_s']} s into the run",
                  f"  rank 1: exit {iso['rank1_exit_code']} after "
                  f"{iso['rank1_exit_after_kill_s']} s (deadline {iso['heartbeat_deadline_s']} s)"
                  f"; verdicts {[(v.get('where'), v.get('reason')) for v in iso['rank1_verdicts']]}"
                  f"; failed closed: {iso['rank1_failed_closed']}",
                  f"  rank 0: {iso['rank0']['steps']} + {iso['rank0_after']['steps']} steps, "
                  f"wrong words {iso['rank0']['wrong_words']} + "
                  f"{iso['rank0_after']['wrong_words']}, state {iso['rank0']['state']}, "
                  f"chunk median us {iso['rank0_chunk_median_us']}; "
                  f"kept correct: {iso['rank0_kept_correct']}"]
    if res.get("skipped_tokens"):
        lines.append(f"skipped (budget): T = {res['skipped_tokens']}")
    lines.append(f"run time {res.get('seconds')} s")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
