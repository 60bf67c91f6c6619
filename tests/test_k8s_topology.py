"""Local Ray clusters shaped like the manifests' groups: the app lands as the manifests say.

- CPU manifest: one Ray node per pod (same CPUs, GPUs and memory as the pod's Ray start
  parameters), the manifest's own serveConfigV2 deployed as KubeRay deploys it (real Serve,
  real vLLM-CPU). Each offload actor runs on its worker's node, in the replica's placement
  group, and the replica's processes fit the memory the pod was given for them.
- GPU manifest: fake-GPU nodes shaped like its pods. Ray Serve LLM's own placement groups for
  the app (as many as its max replicas) and the ingress fit exactly (no vLLM needed).

Loopback only; every wait is bounded; everything started here is stopped and checked gone.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import ray
import requests
import yaml
from ray.cluster_utils import Cluster

from ray_ple.tools.k8s.sizing import group_name, ingress_demand, model_demands
from ray_ple.tools.k8s.spec import load_spec
from ray_ple.tools.quantity import parse_bytes
from tests.leftovers import ple_shm_entries

ROOT = Path(__file__).resolve().parents[1]
SPECS = {m.file: m for m in load_spec(ROOT).manifests}
DEPLOY_TIMEOUT_S = 420


def _manifest(file: str) -> dict[str, Any]:
    return next(d for d in yaml.safe_load_all((ROOT / "k8s" / file).read_text()) if d)


def _node_args(group: dict[str, Any], container: dict[str, Any]) -> dict[str, Any]:
    """What KubeRay's `ray start` gets for this pod: its Ray CPUs/GPUs and memory limit."""
    params = group["rayStartParams"]
    args: dict[str, Any] = {"num_cpus": int(params["num-cpus"]),
                            "num_gpus": int(params.get("num-gpus", "0")),
                            "memory": parse_bytes(container["resources"]["limits"]["memory"])}
    if "object-store-memory" in params:
        args["object_store_memory"] = int(params["object-store-memory"])
    else:
        args["object_store_memory"] = 128 << 20
    return args


def _shaped_cluster(doc: dict[str, Any], pods: str) -> tuple[Cluster, list[dict[str, Any]]]:
    """Head + one node per worker pod (`pods`: 'replicas' or 'maxReplicas' of each group)."""
    spec = doc["spec"]["rayClusterConfig"]
    head = spec["headGroupSpec"]
    cluster = Cluster(initialize_head=True, head_node_args=_node_args(
        head, head["template"]["spec"]["containers"][0]))
    shapes = []
    for group in spec["workerGroupSpecs"]:
        args = _node_args(group, group["template"]["spec"]["containers"][0])
        for _ in range(group[pods]):
            cluster.add_node(**args)
            shapes.append(args)
    cluster.wait_for_nodes()
    return cluster, shapes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(what: str, timeout_s: float, probe) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = probe()
        if got:
            return got
        time.sleep(1)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def _gone(pids: list[int], timeout_s: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout_s
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p)
                 and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.5)
    return alive


@pytest.fixture()
def cpu_app() -> Iterator[dict[str, Any]]:
    """The CPU manifest's cluster and app, deployed from its serveConfigV2."""
    from ray import serve
    from ray.serve._private import api as serve_api
    from ray.serve.schema import ServeDeploySchema

    doc = _manifest("rayservice-tiny-cpu.yaml")
    config = yaml.safe_load(doc["spec"]["serveConfigV2"])
    port = _free_port()
    config["http_options"] = {**config["http_options"], "host": "127.0.0.1", "port": port}
    schema = ServeDeploySchema.model_validate(config)
    cluster, shapes = _shaped_cluster(doc, "replicas")
    pids: list[int] = []
    ray.init(address=cluster.address)
    try:
        client = serve_api.serve_start(http_options=schema.http_options.model_dump(),
                                       proxy_location=schema.proxy_location)
        client.deploy_apps(schema, _blocking=False)
        app_name = config["applications"][0]["name"]

        def running() -> bool:
            status = serve.status().applications.get(app_name)
            if status is not None and status.status == "DEPLOY_FAILED":
                raise AssertionError(f"deploy failed: {status.message}")
            return status is not None and status.status == "RUNNING"

        _wait(f"application {app_name} RUNNING", DEPLOY_TIMEOUT_S, running)
        yield {"doc": doc, "config": config, "port": port, "shapes": shapes, "pids": pids,
               "head_id": cluster.head_node.node_id}
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            cluster.shutdown()
    assert _gone(pids) == [], "processes of the app outlived the cluster"
    assert not [e for e in ple_shm_entries() if any(f"-{p}-" in e for p in pids)]


def _alive_actors() -> list[Any]:
    from ray.util.state import list_actors

    return list_actors(filters=[("state", "=", "ALIVE")], detail=True, limit=1000)


def _tree_rss(pid: int) -> tuple[int, list[str]]:
    proc = psutil.Process(pid)
    procs = [proc, *proc.children(recursive=True)]
    return sum(p.memory_info().rss for p in procs), [" ".join(p.cmdline())[:40] for p in procs]


@pytest.mark.slow
def test_cpu_manifest_places_each_offload_actor_beside_its_worker(cpu_app):
    from ray import serve

    spec = SPECS["rayservice-tiny-cpu.yaml"]
    app = cpu_app["config"]["applications"][0]
    demand = model_demands(app, spec.checkpoint_configs)[0]
    actors = _alive_actors()
    replicas = [a for a in actors if a.class_name.startswith(f"ServeReplica:{app['name']}:")
                and a.class_name.endswith(f":{demand.model_id}")]
    offloads = [a for a in actors if a.class_name == "OffloadActor"]
    assert len(replicas) == demand.min_replicas == 1, sorted(a.class_name for a in actors)
    replica = replicas[0]
    cpu_app["pids"] += [replica.pid] + [a.pid for a in offloads]
    assert len(offloads) == demand.world_size * len(replicas)

    # Each offload actor: the replica's node and placement group (vLLM-CPU runs its worker
    # processes inside the replica, so that is the worker's node).
    assert replica.node_id != cpu_app["head_id"], "no replica on the head (num-cpus 0)"
    for actor in offloads:
        assert actor.node_id == replica.node_id
        assert actor.placement_group_id == replica.placement_group_id
    pg = ray.util.placement_group_table()[replica.placement_group_id]
    assert pg["strategy"] == demand.strategy
    assert set(pg["bundles_to_node_id"].values()) == {replica.node_id}
    assert [pg["bundles"][i] for i in sorted(pg["bundles"])] == list(demand.bundles)

    engine = [p for p in psutil.Process(replica.pid).children(recursive=True)
              if "VLLM::Worker" in " ".join(p.cmdline()) or p.name().startswith("VLLM::Worker")]
    assert len(engine) == demand.world_size, "engine workers run inside the replica"
    cpu_app["pids"] += [p.pid for p in engine]

    handle = serve.get_deployment_handle(replica.class_name.split(":", 2)[2],
                                         app_name=app["name"])
    pairs = handle.ple_status.remote().result(timeout_s=60)
    assert [p.state for p in pairs] == ["READY"] * demand.world_size
    assert {p.node_id for p in pairs} == {replica.node_id}
    assert sorted(p.pid for p in pairs) == sorted(a.pid for a in offloads)

    reply = requests.post(f"http://127.0.0.1:{cpu_app['port']}/v1/completions", timeout=120,
                          json={"model": demand.model_id, "prompt": "w5 w6 w7",
                                "max_tokens": 4, "temperature": 0})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 4

    # The replica's processes and offload actors fit what the pod budgets for them.
    est = spec.workers.estimates
    rss, names = _tree_rss(replica.pid)
    rss += sum(psutil.Process(a.pid).memory_info().rss for a in offloads)
    budget = (demand.world_size * (parse_bytes(est.engine_host_per_worker)
                                   + parse_bytes(est.offload_actor)) + demand.kv_host_bytes)
    print(f"replica tree + offload actors RSS {rss / 2**30:.2f} GiB ({names}); "
          f"budget {budget / 2**30:.2f} GiB")
    assert rss <= budget


def test_gpu_manifest_pods_hold_ray_serve_llms_own_placement_groups():
    """Ray Serve LLM's real placement groups for the GPU app fit the GPU pods, exactly."""
    from ray.llm._internal.serve.core.server.llm_server import LLMServer
    from ray.util.placement_group import placement_group, remove_placement_group

    from ray_ple.serve.builder import validate_args

    spec = SPECS["rayservice-gemma4-e4b-gpu.yaml"]
    doc = _manifest(spec.file)
    app = yaml.safe_load(doc["spec"]["serveConfigV2"])["applications"][0]
    demand = model_demands(app, spec.checkpoint_configs)[0]
    ingress = ingress_demand(app)
    llm, _ = validate_args(app["args"])[0]
    cluster, shapes = _shaped_cluster(doc, "maxReplicas")
    groups = []
    ray.init(address=cluster.address)
    try:
        assert len(shapes) * spec.workers.replicas_per_pod == demand.max_replicas
        assert all(s["num_gpus"] == demand.replica_gpus for s in shapes)
        options = LLMServer.get_deployment_options(llm)  # Ray's own bundles for a replica
        bundles = options["placement_group_bundles"]
        assert [{k: float(v) for k, v in b.items()} for b in bundles] == list(demand.bundles)
        for _ in range(demand.max_replicas):
            groups.append(placement_group(bundles, strategy=options["placement_group_strategy"]))
        for _ in range(ingress.max_replicas):
            groups.append(placement_group([{"CPU": ingress.cpus}], strategy="STRICT_PACK"))
        assert ray.get([g.ready() for g in groups], timeout=60)
        nodes = {n: 0 for n in (x["NodeID"] for x in ray.nodes() if x["Alive"])}
        for g in groups[:demand.max_replicas]:
            placed = set(ray.util.placement_group_table(g)["bundles_to_node_id"].values())
            assert len(placed) == 1, "a replica stays in one pod"
            nodes[placed.pop()] += 1
        assert sorted(nodes.values()) == [0] + [spec.workers.replicas_per_pod] * len(shapes)
        one_more = placement_group(bundles, strategy=options["placement_group_strategy"])
        groups.append(one_more)
        ready, _ = ray.wait([one_more.ready()], timeout=3)
        assert not ready, "pods hold more GPUs than the app's max replicas"
        assert group_name(demand.model_id) in {
            g["groupName"] for g in doc["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    finally:
        for g in groups:
            remove_placement_group(g)
        ray.shutdown()
        cluster.shutdown()
