"""Engines in their own processes against one module's Ray cluster (tests/engine_job.py)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import ray

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def local_cluster() -> Iterator[str]:
    """A module's Ray cluster (use as a module-scoped fixture); yields its address."""
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def run_job(address: str, job: dict, module: str = "tests.engine_job",
            env: dict | None = None) -> dict:
    """One engine run in its own process; its `RESULT` line as a dict."""
    (result,) = run_jobs(address, [job], module, env)
    return result


def start_job(address: str, job: dict, module: str = "tests.engine_job",
              env: dict | None = None) -> subprocess.Popen:
    """An engine run started in its own process group (several engines can share a GPU; the
    group is what `finish_jobs` ends: the run and vLLM's engine processes under it)."""
    return subprocess.Popen([sys.executable, "-m", module, json.dumps(job)],
                            env={**os.environ, "RAY_ADDRESS": address, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            start_new_session=True)


def finish_jobs(procs: list[subprocess.Popen], timeout_s: float = 900) -> list[dict]:
    """The `RESULT` lines of started runs, in order; a run that failed fails the caller
    (with its output), and every run still going is then killed."""
    try:
        results = []
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=timeout_s)
            lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
            assert proc.returncode == 0 and lines, stdout[-3000:] + stderr[-5000:]
            results.append(json.loads(lines[-1][len("RESULT "):]))
        return results
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # what is left of a run that failed
            proc.wait(10)


def run_jobs(address: str, jobs: list[dict], module: str = "tests.engine_job",
             env: dict | None = None, timeout_s: float = 900) -> list[dict]:
    """Engine runs at once, each in its own process; their results in the order of `jobs`."""
    return finish_jobs([start_job(address, job, module, env) for job in jobs], timeout_s)


def flat(tokens: list[list[list[int]]]) -> list[list[int]]:
    return [t for batch in tokens for t in batch]
