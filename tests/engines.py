"""Engines in their own processes against one module's Ray cluster (tests/engine_job.py)."""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO

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


@dataclass
class Job:
    """A started engine run: its process and the files its output goes to (files, not pipes:
    a run whose pipe is full would wait on a reader busy with another run)."""

    proc: subprocess.Popen
    stdout: IO[str]
    stderr: IO[str]

    def output(self) -> tuple[str, str]:
        self.stdout.seek(0)
        self.stderr.seek(0)
        return self.stdout.read(), self.stderr.read()


def report(result: dict, exit_s: float = 60) -> None:
    """A run's last word: its `RESULT` line. A run that then does not exit within `exit_s`
    prints every thread's stack and exits 1: a hang at exit fails with its place, instead of
    a run that never ends (`finish_jobs` keeps its output)."""
    print("RESULT " + json.dumps(result), flush=True)
    faulthandler.dump_traceback_later(exit_s, exit=True)


def start_job(address: str, job: dict, module: str = "tests.engine_job",
              env: dict | None = None) -> Job:
    """An engine run started in its own process group (several engines can share a GPU; the
    group is what `finish_jobs` ends: the run and vLLM's engine processes under it)."""
    stdout, stderr = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, "-m", module, json.dumps(job)],
                            env={**os.environ, "RAY_ADDRESS": address, **(env or {})},
                            stdout=stdout, stderr=stderr, text=True, cwd=REPO,
                            start_new_session=True)
    return Job(proc, stdout, stderr)


def finish_jobs(jobs: list[Job], timeout_s: float = 900,
                keep_failures: bool = False) -> list[dict]:
    """The `RESULT` lines of started runs, in order, all within `timeout_s`; a run that failed
    or ran out of time fails the caller with its output, or with `keep_failures` stands in
    the list as `{"failed": why, "output": its last lines}`. Every run still going is then
    killed."""
    deadline = time.monotonic() + timeout_s
    try:
        results = []
        for job in jobs:
            try:
                job.proc.wait(max(0.0, deadline - time.monotonic()))
                why = f"exit {job.proc.returncode}"
            except subprocess.TimeoutExpired:
                why = f"still running after {timeout_s:.0f} s"
                _end(job)
            stdout, stderr = job.output()
            lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
            if job.proc.returncode == 0 and lines:
                results.append(json.loads(lines[-1][len("RESULT "):]))
                continue
            if lines:
                why += ", after its RESULT"
            output = stdout[-3000:] + stderr[-12000:]  # the stacks of a run hung at exit
            assert keep_failures, f"{why}\n{output}"
            results.append({"failed": why, "output": output})
        return results
    finally:
        for job in jobs:
            _end(job)
            job.stdout.close()
            job.stderr.close()


def _end(job: Job) -> None:
    """What is left of a run: its whole process group (vLLM's engine processes too)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(job.proc.pid, signal.SIGKILL)
    job.proc.wait(10)


def run_jobs(address: str, jobs: list[dict], module: str = "tests.engine_job",
             env: dict | None = None, timeout_s: float = 900) -> list[dict]:
    """Engine runs at once, each in its own process; their results in the order of `jobs`."""
    return finish_jobs([start_job(address, job, module, env) for job in jobs], timeout_s)


def flat(tokens: list[list[list[int]]]) -> list[list[int]]:
    return [t for batch in tokens for t in batch]
