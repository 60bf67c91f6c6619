"""Ray Serve on the GPU: `serve run` of the GPU config serves Gemma 4 E4B's geometry with the
PLE table offloaded, and survives the loss of its offload actor.

The model is a random-weight checkpoint of E4B's text geometry (`bench/cuda/geometry_model.py`,
~14 GiB, word tokenizer `w<i>`), built once into `RAY_PLE_GPU_GEOMETRY_DIR` (default
/tmp/ray-ple-geometry/gemma-4-E4B). The config is `serve_configs/gemma4-e4b-gpu.yaml` with
that checkpoint, one replica, half the GPU and one CPU for the offload actor.

The test: the first completion; each greedy prompt's tokens (twice: the engine repeats
itself); a long greedy stream during which the replica's offload actor is SIGKILLed (what it
delivered is a prefix of that prompt's tokens: nothing computed from a missing row comes
back); the supervisor's verdict (PEER_DEAD); a new replica with a new offload actor (another
pid) and nothing of the old one left; then the same prompts give the same tokens. Requests go
one at a time (batch 1): random bf16 weights make near-ties that another batch shape may
round apart, so only identical steps must give identical tokens.

Every step prints one JSON line as it happens (`{"event": ...}`), so a log cut short shows
how far it got. `RAY_PLE_GPU_SERVE_LOG` keeps `serve run`'s own output at that path.

Runs where vLLM's CUDA build and a GPU are present (`scripts/gpu_device_run.sh serve`);
elsewhere it is skipped with the reason.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests
import yaml

from tests.faultrig import alive
from tests.gpu.vllm_cuda import needs_vllm_cuda
from tests.serving import BASE, REPO, ServeRun, complete, load_config

pytestmark = [pytest.mark.gpu, pytest.mark.slow, needs_vllm_cuda("serve")]

GEOMETRY = "gemma-4-E4B"
CHECKPOINT = Path(os.environ.get("RAY_PLE_GPU_GEOMETRY_DIR",
                                 f"/tmp/ray-ple-geometry/{GEOMETRY}"))
CONFIG = "gemma4-e4b-gpu.yaml"
DASHBOARD = "http://127.0.0.1:8265"
MODEL = "gemma-4-e4b"  # the config's model_id
# short prompts (under one KV block, so no prefix-cache hit changes a later run's steps), ids
# from the start to the end of the 262,144-row table
PROMPTS = ["w5 w6 w7 w8", "w100 w101", "w200000 w262143 w7 w131072 w9"]
MAX_TOKENS = 16
LONG_PROMPT = "w17 w18 w19 w60000"
LONG_TOKENS = 512
KILL_AFTER_TOKENS = 16  # of the long stream, received before the offload actor is killed
FIRST_START_S = 420
REPLACE_S = 300
REQUEST_S = 120


class Progress:
    """One JSON line per event, straight to the terminal (past pytest's capture)."""

    def __init__(self, capsys: pytest.CaptureFixture[str]) -> None:
        self.t0 = time.monotonic()
        self._capsys = capsys

    def __call__(self, event: str, **fields: Any) -> None:
        line = json.dumps({"event": event, "t_s": round(time.monotonic() - self.t0, 1),
                           **fields}, default=str)
        with self._capsys.disabled():
            print(line, flush=True)


class LogWatch:
    """Echoes the milestones of a start as they reach `serve run`'s output: ray-ple's events
    (table load, pairs, replica ready, verdict) and vLLM's (weights, compile, CUDA graphs)."""

    EVENTS = ("build_model", "table_load", "table_hold", "table_huge_pages", "offload_ready",
              "pairs_ready", "pair_attached", "cuda_transport_ready", "replica_ready",
              "verdict", "verdict_record_failed", "replica_ended")
    VLLM = ("Loading weights took", "Model loading took", "torch.compile takes",
            "Directly load the compiled graph", "Graph capturing finished", "init engine",
            "Traceback", "ERROR", "Error:")

    def __init__(self, log: Path, progress: Progress) -> None:
        self.log, self._progress, self._offset = log, progress, 0

    def poll(self) -> None:
        try:
            with open(self.log, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return
        end = data.rfind(b"\n") + 1  # whole lines only
        self._offset += end
        for line in data[:end].decode(errors="replace").splitlines():
            if '{"ray_ple":"' in line:
                try:
                    record = json.loads(line[line.index('{"ray_ple":"'):])
                except ValueError:
                    continue
                if record["ray_ple"] in self.EVENTS:
                    self._progress("log", **{f"ple_{k}": v for k, v in record.items()})
            elif any(m in line for m in self.VLLM):
                self._progress("log", line=re.sub(r"\x1b\[[0-9;]*m", "", line)[:400])


class AppStatus:
    """Serve's status of the application (the dashboard's Serve API, as `serve status` reads
    it; None while the dashboard does not answer), echoed when it changes."""

    def __init__(self, progress: Progress) -> None:
        self._progress, self.last = progress, None

    def __call__(self) -> str | None:
        try:
            r = requests.get(f"{DASHBOARD}/api/serve/applications/", timeout=5)
            status = r.json()["applications"]["ple"]["status"] if r.ok else None
        except (requests.RequestException, ValueError, KeyError, TypeError):
            status = None
        if status is not None and status != self.last:
            self._progress("app_status", status=status)
            self.last = status
        return status


def _checkpoint(progress: Progress) -> Path:
    """The geometry checkpoint, built where it is not complete (in its own process: this one
    keeps no CUDA context, so the engines get the whole GPU)."""
    progress("checkpoint", dir=str(CHECKPOINT))
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.cuda.geometry_model", "--model", GEOMETRY, "--out",
         str(CHECKPOINT), "--device", "cuda"], cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    tail: list[str] = []
    for line in proc.stdout:
        tail = [*tail[-40:], line.rstrip()]
        if line.startswith('{"event": "geometry_model_progress"'):
            progress("checkpoint_progress", build=json.loads(line))
    rc = proc.wait(timeout=60)
    assert rc == 0 and (CHECKPOINT / ".complete").exists(), "\n".join(tail)
    progress("checkpoint_ready", complete=(CHECKPOINT / ".complete").read_text())
    return CHECKPOINT


def _config(tmp: Path, checkpoint: Path) -> Path:
    """The shipped GPU config on this checkpoint: one replica, half the GPU (the replacement
    starts while the card still holds nothing else), one CPU for the offload actor, and no
    FlashInfer sampler (not installed on the GPU machine)."""
    cfg = load_config(CONFIG)
    app = cfg["applications"][0]
    (llm,) = app["args"]["llm_configs"]
    llm["model_loading_config"]["model_source"] = str(checkpoint)
    assert llm["model_loading_config"]["model_id"] == MODEL
    deployment = llm["deployment_config"]
    deployment.pop("num_replicas", None)
    deployment["autoscaling_config"] = {"min_replicas": 1, "max_replicas": 1}
    # Triton attention: for E4B's 512-wide global heads vLLM's FlashAttention picks its CuTe
    # kernels, which need the CUTLASS DSL that the GPU bundle does not carry
    llm["engine_kwargs"].update(max_model_len=8192, max_num_seqs=64,
                                gpu_memory_utilization=0.5, attention_backend="TRITON_ATTN")
    llm["ple"]["offload_num_cpus"] = 1
    env = app.setdefault("runtime_env", {}).setdefault("env_vars", {})
    env.update(VLLM_USE_FLASHINFER_SAMPLER="0", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    path = tmp / "gemma4-e4b-gpu-test.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _logged(run: ServeRun, event: str) -> list[dict]:
    """Every `log_event` line of `event` in `serve run`'s output (actors' lines carry Ray's
    prefix before the JSON)."""
    tag = '{"ray_ple":"' + event + '"'
    out = []
    for line in run.log.read_text(errors="replace").splitlines():
        if tag in line:
            try:
                out.append(json.loads(line[line.index(tag):]))
            except ValueError:
                pass  # a line cut short at the end of the file
    return out


def _tree(run: ServeRun, needle: str) -> list[int]:
    """Live processes of this run's own Ray cluster whose command line holds `needle`."""
    pids = []
    for p in psutil.Process(run.proc.pid).children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and needle in " ".join(p.cmdline()):
                pids.append(p.pid)
        except psutil.Error:
            pass
    return sorted(pids)


def _wait(what: str, run: ServeRun, probe, timeout: float, poll: float = 1.0,  # noqa: ANN001
          watch: LogWatch | None = None):
    """`probe()`'s first true value within `timeout`; `serve run` must stay up meanwhile."""
    deadline = time.monotonic() + timeout
    while True:
        if watch is not None:
            watch.poll()
        if run.proc.poll() is not None:
            raise RuntimeError(f"serve run exited waiting for {what}: "
                               f"{run.log.read_text()[-4000:]}")
        if value := probe():
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout}s: {run.log.read_text()[-4000:]}")
        time.sleep(poll)


def _tokens(prompt: str, max_tokens: int = MAX_TOKENS) -> list[int]:
    out = complete(MODEL, prompt, max_tokens)["choices"][0]["token_ids"]
    assert len(out) == max_tokens, out
    return out


def _stream_with_kill(prompt: str, max_tokens: int, kill_pid: int,
                      progress: Progress) -> tuple[list[int], str, float]:
    """A greedy stream; once `KILL_AFTER_TOKENS` have come, SIGKILL `kill_pid`, then read on
    to the stream's end. (tokens delivered, how it ended, when the kill was sent)."""
    r = requests.post(f"{BASE}/v1/completions", timeout=REQUEST_S, stream=True, json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True, "stream": True})
    assert r.status_code == 200, r.text[:2000]
    tokens: list[int] = []
    t_kill = 0.0
    end = "cut"
    try:
        for line in r.iter_lines(decode_unicode=True):
            if not line or not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                end = "done"
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:
                end = f"error: {str(chunk['error'])[:300]}"
                break
            tokens += chunk["choices"][0].get("token_ids") or []
            if not t_kill and len(tokens) >= KILL_AFTER_TOKENS:
                t_kill = time.time()
                os.kill(kill_pid, signal.SIGKILL)
                progress("offload_killed", pid=kill_pid, tokens_streamed=len(tokens))
    except requests.RequestException as exc:
        end = f"exception: {exc!r}"[:300]
    finally:
        r.close()
    if not t_kill:  # the stream ended before the kill point: kill now all the same
        t_kill = time.time()
        os.kill(kill_pid, signal.SIGKILL)
        progress("offload_killed", pid=kill_pid, tokens_streamed=len(tokens), late=True)
    return tokens, end, t_kill


def _sigterm_is_ctrl_c(signum, frame) -> None:  # noqa: ANN001
    """The stage's `timeout` sends SIGTERM: end as Ctrl-C does, so that `serve run` (its own
    session, out of `timeout`'s reach) is stopped by the test's cleanup."""
    raise KeyboardInterrupt(f"signal {signum}")


def test_serve_run_on_the_gpu_replaces_a_replica_whose_offload_actor_is_killed(
        tmp_path, capsys):
    progress = Progress(capsys)
    previous = signal.signal(signal.SIGTERM, _sigterm_is_ctrl_c)
    run: ServeRun | None = None
    try:
        config = _config(tmp_path, _checkpoint(progress))
        log = Path(os.environ.get("RAY_PLE_GPU_SERVE_LOG") or tmp_path / "serve.log")
        log.parent.mkdir(parents=True, exist_ok=True)
        run = ServeRun(config, log)
        progress("serve_run", pid=run.proc.pid, config=str(config), log=str(log))
        watch, status = LogWatch(log, progress), AppStatus(progress)

        # -- the first replica: no request until its start() has returned (no request of a
        # start that timed out queues behind the ones that follow)
        def first_ready() -> list[dict]:
            if status() == "DEPLOY_FAILED":
                raise RuntimeError(f"DEPLOY_FAILED: {run.log.read_text()[-4000:]}")
            return _logged(run, "replica_ready")

        t_start = time.monotonic()
        (first,) = _wait("the first replica_ready", run, first_ready, FIRST_START_S, poll=2,
                         watch=watch)
        progress("replica_ready", replica_pid=first["pid"], worker_pids=first["worker_pids"],
                 s=round(time.monotonic() - t_start, 1))
        run.wait_ready(MODEL, timeout=max(60.0, FIRST_START_S - (time.monotonic() - t_start)))
        watch.poll()
        progress("first_completion", s=round(time.monotonic() - t_start, 1), status=status())
        models = {m["id"] for m in requests.get(f"{BASE}/v1/models", timeout=30).json()["data"]}
        assert MODEL in models, models

        # -- the tokens, each prompt alone, twice: the engine repeats itself
        before = [_tokens(p) for p in PROMPTS]
        assert [_tokens(p) for p in PROMPTS] == before, "greedy tokens differ run to run"
        long_before = _tokens(LONG_PROMPT, LONG_TOKENS)
        progress("reference_tokens", prompts=len(PROMPTS), first=before[0])

        (old_offload,) = _wait("one offload actor", run, lambda: _tree(run, "OffloadActor"),
                               30, watch=watch)
        offload_logged = [e["pid"] for e in _logged(run, "offload_ready")]
        assert offload_logged == [old_offload], (offload_logged, old_offload)
        old = sorted({first["pid"], *first["worker_pids"], old_offload})
        assert alive(old) == old, "the serving replica's processes"
        progress("offload_actor", pid=old_offload, replica_processes=old)

        # -- SIGKILL the offload actor mid-stream: what came back is a prefix of the tokens
        tokens, end, t_kill = _stream_with_kill(LONG_PROMPT, LONG_TOKENS, old_offload,
                                                progress)
        progress("stream_after_kill", tokens=len(tokens), end=end)
        assert tokens == long_before[:len(tokens)], "a streamed token differs: wrong rows"
        assert end != "done" or tokens == long_before, (end, len(tokens))

        # -- the supervisor's verdict, then a new replica with a new offload actor
        def verdict() -> list[dict]:
            return [v for v in _logged(run, "verdict") if v.get("where") == "supervisor"]

        (v,) = _wait("the supervisor's verdict", run, verdict, 60, poll=0.5, watch=watch)
        progress("verdict", reason=v["reason"], after_kill_s=round(v["ts"] - t_kill, 3),
                 detail=v.get("detail", "")[:200])
        # the supervisor saw the killed process die (its pidfd), before any side failed closed
        assert v["reason"] == "PEER_DEAD" and f"pid {old_offload}" in v.get("detail", ""), v

        def two_ready() -> list[dict]:
            status()
            ready = _logged(run, "replica_ready")
            return ready if len(ready) >= 2 else []

        t_replace = time.monotonic()
        (_, second) = _wait("the new replica_ready", run, two_ready, REPLACE_S, poll=2,
                            watch=watch)
        progress("replica_ready", replica_pid=second["pid"], worker_pids=second["worker_pids"],
                 after_kill_s=round(time.time() - t_kill, 1))
        assert second["pid"] != first["pid"]

        def answered() -> list[int] | None:
            try:
                return _tokens(PROMPTS[0])
            except requests.RequestException as exc:  # the new replica not routed to yet
                progress("completion_not_yet", error=repr(exc)[:200])
                return None

        again0 = _wait("a completion from the new replica", run, answered,
                       max(60.0, REPLACE_S - (time.monotonic() - t_replace)), poll=2,
                       watch=watch)
        progress("serving_again", after_kill_s=round(time.time() - t_kill, 1))

        (new_offload,) = _wait("one new offload actor", run,
                               lambda: _tree(run, "OffloadActor"), 30, watch=watch)
        assert new_offload != old_offload
        _wait("the new offload actor's offload_ready", run,
              lambda: new_offload in [e["pid"] for e in _logged(run, "offload_ready")], 30,
              watch=watch)
        _wait("the old replica's processes gone", run, lambda: not alive(old), 30, poll=0.5,
              watch=watch)
        progress("replaced", offload_pid=new_offload, old_offload_pid=old_offload,
                 old_left=alive(old))

        # -- the same prompts, the same tokens
        after = [again0] + [_tokens(p) for p in PROMPTS[1:]]
        long_after = _tokens(LONG_PROMPT, LONG_TOKENS)
        progress("tokens_after", equal=after == before, long_equal=long_after == long_before,
                 status=status())
        assert after == before
        assert long_after == long_before
        assert _tree(run, "OffloadActor") == [new_offload], "no second replacement"
    finally:
        if run is not None:
            run.stop()
            progress("stopped", exit=run.proc.returncode)
        signal.signal(signal.SIGTERM, previous)
