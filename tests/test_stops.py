"""Nothing is left on the node however a service stops: real signals and commands, real
`serve run`, and /dev/shm and the temp dir compared before and after.

What a replica's processes make on the node (vLLM's `psm_*` message queues and
`multiprocessing`'s `sem.mp-*` semaphores in /dev/shm; ZMQ `ipc://` socket files, the
`vllm_dist_*` rendezvous file and `pymp-*` folders in the replica's own temp folder,
`ray-ple-replica-*`; ray-ple's own names) must be gone within 30 s of each stop: SIGKILL of the
replica (Serve replaces it), a redeploy with a changed config (`serve deploy`: Serve replaces
the replica), `serve shutdown`, then Ctrl-C of `serve run`; and, in a second run, SIGTERM to
`serve run` (the replica's destructor and supervisor never run then: Ray stops first). Each
round costs two `serve run` starts and two replica starts; `RAY_PLE_STOP_ROUNDS` rounds
(default 1; `bench/cpu/results/stops5/` records a run of five).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import yaml

from ray_ple.supervision.engine_leftovers import in_use
from tests.serving import ServeRun, load_config, serve_command

pytestmark = pytest.mark.slow
ROUNDS = int(os.environ.get("RAY_PLE_STOP_ROUNDS", "1"))
MODEL = "tiny-gemma4"
GONE_S = 30
# what a replica's processes make in /dev/shm and the temp dir (top-level names; the temp
# files of its processes are in its own `ray-ple-replica-*` folder)
REPLICA_MADE = re.compile(r"^(psm_|sem\.mp-|ray-ple-|[0-9a-f-]{36}$)")
TMP = tempfile.gettempdir()


def node_names() -> set[str]:
    """The replica-made names in /dev/shm and the temp dir now."""
    out = set()
    for d in ("/dev/shm", TMP):
        with os.scandir(d) as it:
            out |= {e.path for e in it if REPLICA_MADE.match(e.name)}
    return out


def leftovers(paths: set[str]) -> set[str]:
    """Of `paths`, those that exist and that no live process maps, holds open, has bound or
    works in (a name a live process still uses is not left behind)."""
    there = {p for p in paths if os.path.lexists(p)}
    if not there:
        return set()
    dirs = {p for p in there if os.path.isdir(p)}
    held = _open_paths()
    return {p for p in there - in_use(there) - dirs if p not in held} | {
        d for d in dirs if not any(h == d or h.startswith(d + "/") for h in held)}


def _open_paths() -> set[str]:
    """Every path a live process on the node holds open or works in."""
    out = set()
    for pid in (int(e.name) for e in os.scandir("/proc") if e.name.isdigit()):
        try:
            out.add(os.readlink(f"/proc/{pid}/cwd"))
            for fd in os.listdir(f"/proc/{pid}/fd"):
                out.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
    return out


def wait_gone(paths: set[str], what: str) -> None:
    deadline = time.monotonic() + GONE_S
    while (left := leftovers(paths)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left == set(), f"{what}: left after {GONE_S} s: {sorted(left)}"


def replica_pid() -> int:
    (pid,) = [p.pid for p in psutil.process_iter(["cmdline"])
              if "PleLLMServer" in " ".join(p.info["cmdline"] or [])
              and "ServeReplica" in " ".join(p.info["cmdline"] or [])]
    return pid


def config(tmp: Path, max_tokens: int = 8) -> Path:
    cfg = load_config()
    app = cfg["applications"][0]
    (llm,) = [m for m in app["args"]["llm_configs"] if m["model_loading_config"]["model_id"]
              == MODEL]
    app["args"]["llm_configs"] = [llm]
    llm["ple"]["max_tokens"] = max_tokens * 32  # a changed config for the redeploy
    llm["engine_kwargs"]["max_num_batched_tokens"] = max_tokens * 32
    path = tmp / f"stops-{max_tokens}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def wait_new_replica(old: int, run: ServeRun, timeout: float = 300) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            pid = replica_pid()
        except ValueError:
            pid = old
        if pid != old:
            run.wait_ready(MODEL, timeout=max(1.0, deadline - time.monotonic()))
            return pid
        time.sleep(1)
    raise TimeoutError(f"no new replica in {timeout} s")


def serve_cli(*args: str) -> None:
    subprocess.run([*serve_command(), *args, "--address", "http://127.0.0.1:8265"],
                   check=True, timeout=120, capture_output=True)


@pytest.mark.parametrize("round_", range(ROUNDS))
def test_each_stop_leaves_nothing(tmp_path, round_):
    before = node_names()
    results = {}
    run = ServeRun(config(tmp_path), tmp_path / "serve-a.log")
    try:
        run.wait_ready(MODEL)
        old = replica_pid()
        made = node_names() - before
        os.kill(old, signal.SIGKILL)  # the replica alone: Serve starts another
        new = wait_new_replica(old, run)
        wait_gone(made, "SIGKILL of the replica")
        results["sigkill-replica"] = len(made)
        made = node_names() - before
        serve_cli("deploy", str(config(tmp_path, max_tokens=16)))  # a changed config
        wait_new_replica(new, run)
        wait_gone(made, "redeploy")
        results["redeploy"] = len(made)
        made = node_names() - before
        serve_cli("shutdown", "-y")
        wait_gone(made, "serve shutdown")
        results["serve-shutdown"] = len(made)
    finally:
        run.stop()  # Ctrl-C
    wait_gone(node_names() - before, "Ctrl-C of serve run")
    run = ServeRun(config(tmp_path), tmp_path / "serve-b.log")
    try:
        run.wait_ready(MODEL)
        made = node_names() - before
        assert made, "a running replica has made names (the check sees them)"
        run.proc.send_signal(signal.SIGTERM)  # `kill -TERM` of serve run, as the issue did
        run.proc.wait(120)
    finally:
        run.stop()
    wait_gone(made | (node_names() - before), "SIGTERM to serve run")
    results["sigterm-serve-run"] = len(made)
    print(json.dumps({"round": round_, "names_made_then_removed": results}))

