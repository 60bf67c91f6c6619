"""A multi-node local Ray cluster serving the tiny model, clients, and fault measurements."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import requests

from tests.serving import BASE, load_config

PROMPTS = [[5, 6, 7, 8], [100, 101], [9, 30, 31, 32], [250, 4], [17, 18, 19, 20, 21]]
MAX_TOKENS = 8


def app_args(faults_file: str) -> dict[str, Any]:
    """The shipped app with short deadlines, fast health checks and fault injection armed."""
    cfg = load_config()
    app = cfg["applications"][0]
    (llm,) = app["args"]["llm_configs"]
    llm["deployment_config"].update(health_check_period_s=1, health_check_timeout_s=5)
    llm["ple"]["deadlines"] = {"step_s": 4, "offload_wait_s": 2, "heartbeat_s": 5,
                               "startup_s": 300}
    llm["runtime_env"] = {"env_vars": {
        **app["runtime_env"]["env_vars"], "RAY_PLE_FAULTS_FILE": faults_file,
        "RAY_PLE_CACHE": os.environ["RAY_PLE_CACHE"]}}
    return {"llm_configs": [llm],
            "ingress_deployment_config": {"ray_actor_options": {"num_cpus": 0}}}


@dataclass
class Outcome:
    t_end: float
    prompt: int
    ok: bool
    tokens: list[int] = field(default_factory=list)
    stream: bool = False
    error: str = ""
    t_start: float = 0.0


class Clients:
    """Threads sending greedy completions (plain and streamed) throughout."""

    def __init__(self, n_plain: int = 2, n_stream: int = 1) -> None:
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(s,), daemon=True)
                         for s in [False] * n_plain + [True] * n_stream]

    def start(self) -> Clients:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def _run(self, stream: bool) -> None:
        rng = random.Random(os.getpid() + id(self) + stream)
        while not self._stop.is_set():
            i = rng.randrange(len(PROMPTS))
            body = {"model": "tiny-gemma4", "prompt": PROMPTS[i], "max_tokens": MAX_TOKENS,
                    "temperature": 0, "ignore_eos": True, "return_token_ids": True}
            t_start = time.time()
            try:
                outcome = self._stream(i, body) if stream else self._plain(i, body)
            except requests.RequestException as exc:
                outcome = Outcome(time.time(), i, False, stream=stream, error=repr(exc)[:200])
            outcome.t_start = t_start
            with self._lock:
                self.outcomes.append(outcome)
            if not outcome.ok:
                time.sleep(0.2)

    @staticmethod
    def _plain(i: int, body: dict) -> Outcome:
        r = requests.post(f"{BASE}/v1/completions", json=body, timeout=30)
        if r.status_code != 200:
            return Outcome(time.time(), i, False, error=f"{r.status_code} {r.text[:200]}")
        return Outcome(time.time(), i, True, r.json()["choices"][0]["token_ids"])

    @staticmethod
    def _stream(i: int, body: dict) -> Outcome:
        r = requests.post(f"{BASE}/v1/completions", json={**body, "stream": True}, timeout=30,
                          stream=True)
        if r.status_code != 200:
            return Outcome(time.time(), i, False, stream=True, error=str(r.status_code))
        tokens: list[int] = []
        done = False
        for line in r.iter_lines(decode_unicode=True):
            if not line or not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return Outcome(time.time(), i, False, tokens, True, str(chunk["error"])[:200])
            tokens += chunk["choices"][0].get("token_ids") or []
        return Outcome(time.time(), i, done and len(tokens) == MAX_TOKENS, tokens, True,
                       "" if done else "stream cut")

    def wrong(self, reference: list[list[int]]) -> list[Outcome]:
        """Responses that delivered tokens differing from the reference (never allowed).

        A failed stream may have delivered a prefix before its error: the prefix must match.
        """
        with self._lock:
            return [o for o in self.outcomes if o.tokens != reference[o.prompt][:len(o.tokens)]
                    or (o.ok and len(o.tokens) != MAX_TOKENS)]

    def first_success_after(self, t: float) -> float | None:
        with self._lock:
            times = [o.t_end for o in self.outcomes if o.ok and o.t_end > t]
        return min(times) if times else None

    def between(self, t0: float, t1: float) -> list[Outcome]:
        """Requests that started in [t0, t1)."""
        with self._lock:
            return [o for o in self.outcomes if t0 <= o.t_start < t1]

    def counts(self) -> tuple[int, int]:
        with self._lock:
            ok = sum(o.ok for o in self.outcomes)
            return ok, len(self.outcomes) - ok


def supervisor_pids() -> dict[int, str]:
    """Process roles of the live, serving replica, as its supervisor knows them."""
    replicas = serving_replicas()
    return replicas[0] if replicas else {}


def serving_replicas() -> list[dict[int, str]]:
    """Process roles of every live, serving replica, as their supervisors know them."""
    import ray

    out = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if not entry["name"].startswith("ray-ple-supervisor-"):
            continue
        try:
            sup = ray.get_actor(entry["name"], namespace=entry["namespace"])
            pids = {int(k): v for k, v in ray.get(sup.pids.remote(), timeout=5).items()}
        except Exception:  # noqa: BLE001 - a supervisor that is ending
            continue
        if any(r.startswith("worker") for r in pids.values()) and len(alive(list(pids))) == len(
                pids):
            out.append(pids)
    return out


def pid_of(role: str) -> int:
    for pid, r in supervisor_pids().items():
        if r == role:
            return pid
    raise LookupError(f"no live process with role {role}")


def signal_pid(pid: int, sig: int) -> float:
    t = time.time()
    os.kill(pid, sig)
    return t


def alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def fired_at(marker: Path, timeout: float = 120) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if marker.exists() and marker.stat().st_size:
            return json.loads(marker.read_text())["time"]
        time.sleep(0.05)
    raise TimeoutError(f"fault {marker.name} never fired")


class LogTail:
    """Lines appended to a Ray session's log files (every node of a local cluster writes
    under one session directory) since the last `mark()`: the sides' and the supervisor's
    `verdict` lines, and the errors a replica's setup ends with."""

    _VERDICT = re.compile(r'\{"ray_ple":"verdict".*\}')

    def __init__(self, logs_dir: str) -> None:
        self.dir = Path(logs_dir)
        self._offsets: dict[Path, int] = {}
        self._lines: list[str] = []
        self.mark()

    def _read(self) -> None:
        for path in self.dir.rglob("*"):
            if path.suffix not in (".out", ".err", ".log") or not path.is_file():
                continue
            start = self._offsets.get(path, 0)
            try:
                with open(path, "rb") as f:
                    f.seek(start)
                    data = f.read()
            except OSError:
                continue
            end = data.rfind(b"\n") + 1  # whole lines only
            self._offsets[path] = start + end
            self._lines += data[:end].decode(errors="replace").splitlines()

    def mark(self) -> None:
        self._read()
        self._lines = []

    def find(self, text: str, timeout: float = 0.0) -> str | None:
        """The first line since the mark that contains `text` (waiting up to `timeout`)."""
        deadline = time.monotonic() + timeout
        while True:
            self._read()
            for line in self._lines:
                if text in line:
                    return line
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.5)

    def verdicts(self, timeout: float = 5.0, until: str = "supervisor") -> list[dict]:
        """Every `verdict` line since the mark, earliest first (waiting up to `timeout` for
        one written `where=until`): which side named the cause, and when."""
        deadline = time.monotonic() + timeout
        while True:
            self._read()
            found = sorted((json.loads(m.group(0)) for line in self._lines
                            if (m := self._VERDICT.search(line))), key=lambda v: v["ts"])
            if any(v.get("where") == until for v in found) or time.monotonic() >= deadline:
                return found
            time.sleep(0.25)


__all__ = ["LogTail", "Clients", "app_args", "pid_of", "signal_pid", "alive", "fired_at", "signal",
           "supervisor_pids", "PROMPTS", "MAX_TOKENS"]
