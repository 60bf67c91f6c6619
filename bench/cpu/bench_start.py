"""`serve run` to a served completion: ray-ple vs the same application with the offload off.

Each round starts `serve run` twice, a fresh Ray cluster each time as a user's (the order
alternating between rounds): the shipped `serve_configs/ple.yaml` as it is (`ple`), and the
same application with `ple.enabled: false` (`plain`: Ray Serve LLM's own `LLMServer`, the
same engine arguments and placement). Per start: seconds from `serve run` to `/v1/models`
answering, to Serve's application status RUNNING (`ray-ple ready`'s signal), and to the first
200 of a one-token completion; the replica's start phases from its log lines (ray-ple's
events and vLLM's); then Ctrl-C and the wait until its processes are gone. Every figure is a
difference or ratio of one round; the summary is the median over rounds.

    python bench/cpu/bench_start.py --out bench/cpu/results/<run> --rounds 3

This is a benchmark, not a test: it asserts nothing about time.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import requests
import yaml

REPO = Path(__file__).resolve().parents[2]
BASE = "http://127.0.0.1:8000"
DASHBOARD = "http://127.0.0.1:8265"
MODEL = "tiny-gemma4"
SIDES = ("ple", "plain")
ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
       "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "RAY_ADDRESS": "local"}
# (phase, pattern in the serve run log): the first line matching each, with its time
PHASES = {
    "replica_start": r"Starting with engine config|ray_ple.*\"build_model\"",
    "pairs_ready": r"\"ray_ple\":\"pairs_ready\"",
    "inspect_model": r"Registry inspect model class",
    "engine_init": r"Initializing a V1 LLM engine",
    "weights_loaded": r"Loading weights took",
    "kv_cache": r"KV cache size",
    "engine_ready": r"init engine .* took|Engine core initialization took",
    "replica_ready": r"\"ray_ple\":\"replica_ready\"",
}
_TS = re.compile(r"(\d\d:\d\d:\d\d)[,.](\d+)")


def config(side: str) -> Path:
    cfg = yaml.safe_load((REPO / "serve_configs" / "ple.yaml").read_text())
    if side == "plain":
        for app in cfg["applications"]:
            for llm in app["args"]["llm_configs"]:
                llm["ple"] = {"enabled": False}
    path = Path(f"/tmp/ray-ple-bench-start-{side}.yaml")
    path.write_text(yaml.safe_dump(copy.deepcopy(cfg)))
    return path


def app_status() -> str | None:
    from ray_ple.tools.ready import app_status as status

    try:
        return status(DASHBOARD, "ple")[0]
    except PermissionError:
        return None


def one_start(side: str, log: Path, timeout: float) -> dict[str, Any]:
    serve = Path(sys.executable).with_name("serve")
    t0 = time.monotonic()
    wall0 = time.time()
    with open(log, "w") as out:
        proc = subprocess.Popen([str(serve), "run", str(config(side))], cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **ENV})
    at: dict[str, float] = {}
    try:
        while "first_completion" not in at and time.monotonic() - t0 < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"serve run exited: {log.read_text()[-3000:]}")
            now = time.monotonic() - t0
            try:
                if "models" not in at and requests.get(f"{BASE}/v1/models",
                                                       timeout=2).status_code == 200:
                    at["models"] = now
                if "running" not in at and app_status() == "RUNNING":
                    at["running"] = time.monotonic() - t0
                if "models" in at:
                    r = requests.post(f"{BASE}/v1/completions", timeout=30, json={
                        "model": MODEL, "prompt": "w5", "max_tokens": 1})
                    if r.status_code == 200:
                        at["first_completion"] = time.monotonic() - t0
            except requests.RequestException:
                pass
            time.sleep(0.5)
    finally:
        stop(proc)
    at["phases"] = phases(log.read_text(), wall0)
    return {k: (round(v, 1) if isinstance(v, float) else v) for k, v in at.items()}


def phases(text: str, wall0: float) -> dict[str, float]:
    """Seconds from `serve run` to the first log line of each phase (its own time stamp:
    ray-ple's `ts`, or vLLM's and Ray's hh:mm:ss on this day)."""
    day = time.strftime("%Y-%m-%d", time.localtime(wall0))
    out = {}
    for name, pattern in PHASES.items():
        for line in text.splitlines():
            if not re.search(pattern, line):
                continue
            if (m := re.search(r"\"ts\":([\d.]+)", line)) is not None:
                t = float(m.group(1))
            elif (m := _TS.search(line)) is not None:
                t = time.mktime(time.strptime(f"{day} {m.group(1)}", "%Y-%m-%d %H:%M:%S"))
                t += float("0." + m.group(2))
            else:
                continue
            out[name] = round(t - wall0, 1)
            break
    return out


def stop(proc: subprocess.Popen) -> None:
    """Ctrl-C, then wait until every process of the run is gone (the next start is clean)."""
    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        tree = []
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    _, alive = psutil.wait_procs(tree, timeout=30)
    for p in alive:
        p.kill()
    time.sleep(3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for r in range(args.rounds):
        order = SIDES if r % 2 == 0 else SIDES[::-1]
        row: dict[str, Any] = {"round": r, "order": list(order)}
        for side in order:
            row[side] = one_start(side, args.out / f"serve-{r}-{side}.log", args.timeout)
            print(json.dumps({"round": r, "side": side, **row[side]}), flush=True)
        rows.append(row)
        with open(args.out / "rounds.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
    summary = {}
    for key in ("models", "running", "first_completion"):
        diffs = [row["ple"][key] - row["plain"][key] for row in rows
                 if key in row["ple"] and key in row["plain"]]
        ratios = [row["ple"][key] / row["plain"][key] for row in rows
                  if key in row["ple"] and key in row["plain"]]
        if diffs:
            summary[key] = {"ple_minus_plain_s": round(statistics.median(diffs), 1),
                            "ratio": round(statistics.median(ratios), 3),
                            "ple_s": statistics.median(row["ple"][key] for row in rows),
                            "plain_s": statistics.median(row["plain"][key] for row in rows)}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
