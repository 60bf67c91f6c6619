"""The replica's reaper removes what a killed process tree left on the node, and only that.

A real tree (a root and its child, as a replica and its engine core, the root's temp dir a
folder of its own as `replica_tmpdir` makes it) makes what vLLM's processes make: a
`multiprocessing.shared_memory` segment (`psm_*`), a `multiprocessing` semaphore
(`sem.mp-*`), a bound ZMQ-style `ipc://` socket file, a `vllm_dist_*` rendezvous file and a
`pymp-*` folder in the temp dir; then the whole tree is SIGKILLed, so nothing of its own
cleanup runs. The reaper, started as the server starts it, leaves none of them, keeps a
segment another live process still maps, and exits.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from multiprocessing import shared_memory
from pathlib import Path

import psutil

from ray_ple.supervision.reaper import start_reaper

CHILD = r"""
import json, multiprocessing, os, socket, sys, tempfile, time
from multiprocessing import shared_memory, util
seg = shared_memory.SharedMemory(create=True, size=1 << 16)
lock = multiprocessing.get_context("spawn").Lock()   # sem.mp-* in /dev/shm
ipc = os.path.join(tempfile.gettempdir(), f"ray-ple-test-ipc-{os.getpid()}")
sock = socket.socket(socket.AF_UNIX); sock.bind(ipc); sock.listen()
open(os.path.join(tempfile.gettempdir(), f"vllm_dist_test{os.getpid()}"), "w").close()
pymp = util.get_temp_dir()
print(json.dumps({"psm": "/dev/shm/" + seg.name.lstrip("/"), "ipc": ipc,
                  "pymp": pymp, "tmp": tempfile.gettempdir()}), flush=True)
time.sleep(600)
"""
ROOT = r"""
import os, subprocess, sys, time
while not os.path.exists(sys.argv[2]):   # the reaper is up: the engine may start
    time.sleep(0.05)
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=sys.stdout)
time.sleep(600)
"""


def _sems() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith("sem.mp-")}


def test_a_killed_tree_leaves_nothing_and_a_live_holder_keeps_its_segment(tmp_path):
    sems_before = _sems()
    out = (tmp_path / "out").open("w+")
    go = tmp_path / "go"
    replica_tmp = tmp_path / "replica-tmp"
    replica_tmp.mkdir()
    root = subprocess.Popen([sys.executable, "-c", ROOT, CHILD, str(go)], stdout=out,
                            start_new_session=True, env={**os.environ, "TMPDIR": str(replica_tmp)})
    start_reaper(root.pid, "test", str(replica_tmp))
    reaper = _wait_for_reaper(root.pid)
    go.touch()
    deadline = time.monotonic() + 60
    while not (made := Path(out.name).read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = json.loads(made)
    # another process maps a segment of the tree's: in use, it must stay
    shared = shared_memory.SharedMemory(name=left["psm"].rsplit("/", 1)[1])
    time.sleep(1.5)  # one inventory at least
    new_sems = _sems() - sems_before
    assert new_sems, "the child's semaphore exists"
    os.killpg(root.pid, signal.SIGKILL)
    root.wait(10)
    try:
        reaper.wait(30)
        assert left["tmp"] == str(replica_tmp) and left["pymp"].startswith(left["tmp"])
        paths = [left["ipc"], left["pymp"], str(replica_tmp)] + [f"/dev/shm/{s}" for s in new_sems]
        assert [p for p in paths if os.path.lexists(p)] == []
        assert os.path.exists(left["psm"]), "a segment a live process maps is kept"
    finally:
        shared.close()
        shared.unlink()


def test_the_reaper_exits_with_the_tree_and_holds_no_folder(tmp_path):
    """An orphan in /; a temp folder a live process still works in is kept."""
    busy = tmp_path / "busy"
    busy.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], cwd=busy)
    root = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    start_reaper(root.pid, "test", str(busy))
    reaper = _wait_for_reaper(root.pid)
    assert reaper.cwd() == "/" and reaper.ppid() != os.getpid(), "an orphan, in /"
    root.kill()
    root.wait(10)
    reaper.wait(15)
    assert not reaper.is_running()
    assert busy.is_dir(), "a folder a live process works in is kept"
    holder.kill()
    holder.wait(10)


def _wait_for_reaper(root: int) -> psutil.Process:
    """The reaper of `root`, once it watches (it leaves its folder for / just before)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for p in psutil.process_iter(["cmdline"]):
            cmd = p.info["cmdline"] or []
            if "ray_ple.supervision.reaper" in cmd and str(root) in cmd and p.cwd() == "/":
                time.sleep(0.5)
                return p
        time.sleep(0.1)
    raise AssertionError(f"no reaper for {root}")


