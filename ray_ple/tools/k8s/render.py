"""Render `k8s/*.yaml` from `k8s/spec/clusters.yaml` and `serve_configs/*.yaml`.

`serveConfigV2` is the serve config itself, its proxies moved to every pod's Serve port
(`serve_config_v2`). Pod resources come from `ray_ple.tools.k8s.sizing`. Every GPU or CPU worker pod
runs `ray-ple doctor` as an init container with the numbers it was sized for, so a node that
cannot hold them fails at start with one line per check.

    ray-ple render-k8s            # write k8s/*.yaml and k8s/README.md's sizing table
    ray-ple render-k8s --check    # exit 1 if a committed manifest or that table differs

The sizing table in `k8s/README.md` (between `README_BEGIN` and `README_END`) is generated too,
so that every figure an operator reads there is the one the manifests were sized with.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from ray_ple.errors import PleConfigError
from ray_ple.log import log_event
from ray_ple.tools.k8s.sizing import (
    IngressDemand,
    ModelDemand,
    PodBudget,
    ingress_demand,
    model_demands,
    pod_budget,
)
from ray_ple.tools.k8s.spec import SPEC_PATH, ManifestSpec, load_spec
from ray_ple.tools.quantity import gib_up, human, mib_up, parse_bytes, parse_quantity

SERVE_PORT = 8000
PORTS = {"gcs-server": 6379, "dashboard": 8265, "client": 10001, "serve": SERVE_PORT,
         "metrics": 8080}
DSHM = "dshm"
MODELS = "models"
LABELS = {"app.kubernetes.io/name": "ray-ple", "app.kubernetes.io/part-of": "ray-ple"}
README = Path("k8s") / "README.md"
README_BEGIN = "<!-- sizing:begin -->"
README_END = "<!-- sizing:end -->"


def find_root(root: Path | None = None) -> Path:
    """The project root that holds `k8s/spec/clusters.yaml`: `root` if given, else the nearest
    of the current directory and its parents, else the checkout this package runs from (an
    editable install, as `scripts/install.sh` makes), so `render-k8s` works from anywhere."""
    if root is not None:
        candidates = [root]
    else:
        here = Path.cwd().resolve()
        candidates = [here, *here.parents, Path(__file__).resolve().parents[3]]
    for candidate in candidates:
        if (candidate / SPEC_PATH).is_file():
            return candidate
    where = str(root) if root is not None else (f"{Path.cwd()}, its parents or "
                                                f"{Path(__file__).resolve().parents[3]}")
    raise PleConfigError(f"{SPEC_PATH} not found in {where}: run `ray-ple render-k8s` in a "
                         "ray-ple checkout or pass --root")


def serve_config_v2(serve_config: dict[str, Any]) -> dict[str, Any]:
    """The serve config as KubeRay deploys it; only where the proxies listen changes.

    A proxy on every node, on the pod's Serve port: KubeRay's readiness probe of a RayService
    worker pod asks the proxy on that pod, so `HeadOnly` would leave every worker NotReady
    (ray-project/kuberay#4994).
    """
    out = copy.deepcopy(serve_config)
    out["proxy_location"] = "EveryNode"
    out["http_options"] = {**(out.get("http_options") or {}), "host": "0.0.0.0",
                           "port": SERVE_PORT}
    return out


def _cpu(value: float) -> str:
    return str(int(value)) if value == int(value) else f"{round(value * 1000)}m"


def _resources(budget: PodBudget) -> dict[str, Any]:
    """Memory request == limit (/dev/shm and pinned slots must never be reclaimed from under
    the pod); CPU is a request only, so that gather bursts are not throttled."""
    mem = gib_up(budget.memory_bytes)
    req: dict[str, Any] = {"cpu": _cpu(budget.cpu), "memory": mem}
    lim: dict[str, Any] = {"memory": mem}
    if budget.gpus:
        req["nvidia.com/gpu"] = lim["nvidia.com/gpu"] = str(budget.gpus)
    return {"requests": req, "limits": lim}


def _doctor_args(budget: PodBudget, demand: ModelDemand, spec: ManifestSpec) -> list[str]:
    args = ["ray-ple", "doctor", "--transport", budget.transport if budget.transport != "none"
            else "cpu", "--table-bytes", str(budget.table_bytes), "--pair-bytes",
            str(budget.pair_bytes), "--workers", str(budget.workers), "--object-store-bytes",
            str(budget.object_store_bytes), "--shm-headroom-bytes",
            str(budget.shm_headroom_bytes)]
    if spec.models_volume is not None and not demand.model_source.startswith("ray-ple://"):
        args += ["--checkpoint", demand.model_source, "--dtype", demand.dtype]
    return args


def _mounts(spec: ManifestSpec, shm: bool) -> list[dict[str, Any]]:
    mounts = [{"name": DSHM, "mountPath": "/dev/shm"}] if shm else []
    if spec.models_volume is not None:
        mounts.append({"name": MODELS, "mountPath": spec.models_volume.mount_path,
                       "readOnly": True})
    return mounts


def _volumes(spec: ManifestSpec, shm_bytes: int | None) -> list[dict[str, Any]]:
    vols = []
    if shm_bytes is not None:
        vols.append({"name": DSHM, "emptyDir": {"medium": "Memory",
                                                "sizeLimit": mib_up(shm_bytes)}})
    if spec.models_volume is not None:
        vols.append({"name": MODELS, "persistentVolumeClaim": {
            "claimName": spec.models_volume.claim_name, "readOnly": True}})
    return vols


def _head(spec: ManifestSpec) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "ray-head", "image": spec.image,
        "ports": [{"name": n, "containerPort": p} for n, p in PORTS.items()],
        "resources": {"requests": {"cpu": spec.head.cpu, "memory": spec.head.memory},
                      "limits": {"memory": spec.head.memory}},
    }
    pod: dict[str, Any] = {"containers": [container]}
    if spec.models_volume is not None:
        container["volumeMounts"] = _mounts(spec, shm=False)
        pod["volumes"] = _volumes(spec, None)
    return {
        # No replica on the head: it keeps GCS, the dashboard and the Serve controller.
        "rayStartParams": {"num-cpus": "0", "num-gpus": "0", "dashboard-host": "0.0.0.0"},
        "template": {"metadata": {"labels": dict(LABELS)}, "spec": pod},
    }


def _worker(spec: ManifestSpec, budget: PodBudget, demand: ModelDemand) -> dict[str, Any]:
    resources = _resources(budget)
    mounts = _mounts(spec, shm=True)
    container = {"name": "ray-worker", "image": spec.image, "resources": resources,
                 "volumeMounts": mounts,
                 "ports": [{"name": "serve", "containerPort": SERVE_PORT}]}
    doctor = {"name": "ray-ple-doctor", "image": spec.image,
              "command": _doctor_args(budget, demand, spec),
              "resources": copy.deepcopy(resources), "volumeMounts": copy.deepcopy(mounts)}
    pod: dict[str, Any] = {"initContainers": [doctor], "containers": [container],
                           "volumes": _volumes(spec, budget.shm_bytes)}
    if spec.workers.tolerations:
        pod["tolerations"] = list(spec.workers.tolerations)
    if spec.workers.node_selector:
        pod["nodeSelector"] = dict(spec.workers.node_selector)
    return {
        "groupName": budget.group,
        "replicas": budget.min_pods, "minReplicas": budget.min_pods,
        "maxReplicas": budget.max_pods,
        "rayStartParams": {"num-cpus": str(budget.ray_cpus), "num-gpus": str(budget.gpus),
                           "object-store-memory": str(budget.object_store_bytes)},
        "template": {"metadata": {"labels": {**LABELS, "ray-ple/model": budget.group}},
                     "spec": pod},
    }


def rayservice(spec: ManifestSpec, serve_config: dict[str, Any],
               sized: list[tuple[ModelDemand, IngressDemand, PodBudget]]) -> dict[str, Any]:
    autoscale = any(b.min_pods != b.max_pods for _, _, b in sized)
    cluster: dict[str, Any] = {
        "rayVersion": spec.ray_version,
        # Ray 2.60 turns token authentication on; KubeRay hands the token to every pod.
        "authOptions": {"mode": "token"},
        "enableInTreeAutoscaling": autoscale,
        "headGroupSpec": _head(spec),
        "workerGroupSpecs": [_worker(spec, b, d) for d, _, b in sized],
    }
    if autoscale:
        # An engine takes minutes to start: do not give its pod back after a short lull.
        cluster["autoscalerOptions"] = {"idleTimeoutSeconds": 600}
    return {
        "apiVersion": "ray.io/v1", "kind": "RayService",
        "metadata": {"name": spec.name, "labels": dict(LABELS)},
        "spec": {
            "upgradeStrategy": {"type": spec.upgrade_strategy},
            "serveConfigV2": _dump(serve_config_v2(serve_config)),
            "rayClusterConfig": cluster,
        },
    }


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, s: str) -> yaml.Node:
    return dumper.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None)


_Dumper.add_representer(str, _str)


def _dump(doc: Any) -> str:
    return yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=4096)


def size_manifest(root: Path, spec: ManifestSpec
                  ) -> tuple[dict[str, Any], list[tuple[ModelDemand, IngressDemand, PodBudget]]]:
    """The serve config and, per model, its demand, the ingress and the worker pod budget."""
    serve_config = yaml.safe_load((root / spec.serve_config).read_text())
    apps = serve_config.get("applications") or []
    if len(apps) != 1:
        raise PleConfigError(f"{spec.serve_config}: one application per manifest, got {len(apps)}")
    ingress = ingress_demand(apps[0])
    sized = []
    for demand in model_demands(apps[0], spec.checkpoint_configs):
        budget = pod_budget(demand, ingress, spec.workers.estimates, spec.workers.replicas_per_pod)
        sized.append((demand, ingress, budget))
    return serve_config, sized


def render_manifest(root: Path, spec: ManifestSpec) -> str:
    serve_config, sized = size_manifest(root, spec)
    header = [f"Generated by `ray-ple render-k8s` from {spec.serve_config} and "
              "k8s/spec/clusters.yaml;",
              "edit those and re-run (tests/test_k8s_manifests.py fails if this file differs).",
              "Sizing (k8s/README.md explains each term):"]
    for demand, ingress, budget in sized:
        header += budget.explain(demand, ingress, spec.workers.estimates)
    text = "".join(f"# {line}".rstrip() + "\n" for line in header)
    return text + "---\n" + _dump(rayservice(spec, serve_config, sized))


def _sum(*terms: str) -> str:
    return " + ".join(terms)


def _table_cell(d: ModelDemand) -> str:
    if not d.tables:
        return "none (offload disabled)"
    rows = _sum(*(f"{n:,} rows x {b:,} B + a header page" for n, b in d.tables))
    return f"{rows} = {human(d.table_bytes)} ({d.table_bytes} B)"


def _pair_cell(d: ModelDemand) -> str:
    if not d.pair_bytes:
        return "none"
    rest = d.pair_bytes - d.slot_tokens * d.slot_row_bytes
    return (f"{d.slot_tokens:,} x {d.slot_row_bytes:,} B + {human(rest)} = "
            f"{human(d.pair_bytes)} ({d.pair_bytes} B)")


def _shm_cell(b: PodBudget) -> str:
    terms = _sum(human(b.table_bytes), f"{b.workers} x {human(b.pair_bytes)}",
                 human(b.object_store_bytes), human(b.shm_headroom_bytes))
    return f"{terms} = {human(b.shm_bytes)} -> `{mib_up(b.shm_bytes)}`"


def _memory_cell(b: PodBudget) -> str:
    terms = _sum(human(b.shm_bytes), human(b.process_bytes), human(b.system_bytes))
    return f"{terms} -> `{gib_up(b.memory_bytes)}`"


def _pods_cell(spec: ManifestSpec, b: PodBudget) -> str:
    """Every pod at the minimum pod count (what a try-out cluster must hold), and the GPUs a
    blue/green upgrade needs at the minimum and maximum (two clusters at once)."""
    cpu = parse_quantity(spec.head.cpu) + b.min_pods * b.cpu
    mem = parse_bytes(spec.head.memory) + b.min_pods * parse_bytes(gib_up(b.memory_bytes))
    text = (f"head {spec.head.cpu} CPU / {spec.head.memory} + {b.min_pods} x worker "
            f"{b.cpu:g} CPU / {gib_up(b.memory_bytes)} = {cpu:g} CPUs / {human(mem)}")
    if b.gpus:
        text += (f"; {b.min_pods * b.gpus} to {b.max_pods * b.gpus} GPU(s), "
                 f"{2 * b.min_pods * b.gpus} to {2 * b.max_pods * b.gpus} during a blue/green "
                 "upgrade")
    return text


# (term, rule, cell): the rows of the README's sizing table, one column per worker group.
_ROWS: list[tuple[str, str, Any]] = [
    ("Ray CPUs (`num-cpus`)", "replicas x the replica's placement-group CPUs (each worker "
     "bundle: its offload actor's `offload_num_cpus`; bundle 0 also the replica actor's 1) + "
     "one ingress replica, rounded up",
     lambda s, d, i, b: f"{b.replicas_per_pod} x {d.replica_cpus:g} + {i.cpus:g} = "
                        f"{b.ray_cpus}"),
    ("Ray GPUs (`num-gpus`, `nvidia.com/gpu`)", "replicas x `tensor_parallel_size`",
     lambda s, d, i, b: f"{b.replicas_per_pod} x {d.replica_gpus:g} = {b.gpus}"),
    ("container CPU request", "Ray CPUs + cores Ray books nothing for (vLLM's GPU worker actor "
     "has `num_cpus=0`; EngineCore's loop) + Ray's daemons",
     lambda s, d, i, b: f"{b.ray_cpus} + {b.replicas_per_pod} x "
                        f"{s.workers.estimates.unbooked_cores_per_replica:g} + "
                        f"{s.workers.estimates.system_cores:g} = {b.cpu:g}"),
    ("table", "rows x row bytes (layers x PLE dim x dtype) + a header page, once per pod",
     lambda s, d, i, b: _table_cell(d)),
    ("pair segment", "per engine worker: output slots of `max_num_batched_tokens` rows (the "
     "layers after `resident_layers`) + control block and input slot",
     lambda s, d, i, b: _pair_cell(d)),
    ("`/dev/shm` `sizeLimit`", "table + workers x pair + object store (`object-store-memory`) "
     "+ headroom for vLLM/torch/NCCL",
     lambda s, d, i, b: _shm_cell(b)),
    ("memory request = limit", "`/dev/shm` (tmpfs pages are the pod's memory) + per worker: "
     "engine processes + offload actor + CPU weight offload + per replica: a CPU engine's KV "
     "cache + Ray's daemons, rounded up",
     lambda s, d, i, b: _memory_cell(b)),
    ("memlock per GPU worker", "its pair segment + a page, page-locked (section memlock)",
     lambda s, d, i, b: human(b.memlock_bytes) if b.memlock_bytes else "none (CPU path)"),
    ("pods at the minimum", "the head + the minimum worker pods (`minReplicas`)",
     lambda s, d, i, b: _pods_cell(s, b)),
]


def render_readme_block(root: Path) -> str:
    """The sizing table of `k8s/README.md`: each rule, and its figures for every worker group
    of every manifest, from the same `size_manifest` the manifests come from."""
    columns = []
    for spec in load_spec(root).manifests:
        _, sized = size_manifest(root, spec)
        columns += [(spec, d, i, b) for d, i, b in sized]
    head = ["term", "rule", *(f"`{s.file}` (`{b.group}`)" for s, _, _, b in columns)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for term, rule, cell in _ROWS:
        lines.append("| " + " | ".join([term, rule, *(cell(*c) for c in columns)]) + " |")
    return "\n".join(lines) + "\n"


def _with_readme_block(current: str, block: str) -> str:
    if current.count(README_BEGIN) != 1 or current.count(README_END) != 1 or \
            current.index(README_BEGIN) > current.index(README_END):
        raise PleConfigError(f"{README} must hold one {README_BEGIN!r} ... {README_END!r} "
                             "block for the sizing table")
    before, rest = current.split(README_BEGIN)
    _, after = rest.split(README_END)
    return f"{before}{README_BEGIN}\n{block}{README_END}{after}"


def render_all(root: Path) -> dict[Path, str]:
    """`k8s/<file>` -> its text, for every manifest in `k8s/spec/clusters.yaml`, and
    `k8s/README.md` with its sizing table."""
    out = {root / "k8s" / m.file: render_manifest(root, m) for m in load_spec(root).manifests}
    readme = root / README
    out[readme] = _with_readme_block(readme.read_text(), render_readme_block(root))
    return out


def write_or_check(root: Path, check: bool) -> list[str]:
    """Write the manifests and the README's sizing table, or (check) return the files that
    differ from what is committed."""
    stale = []
    for path, text in render_all(root).items():
        current = path.read_text() if path.exists() else None
        if current != text:
            stale.append(str(path.relative_to(root)))
            if not check:
                path.write_text(text)
    log_event("render_k8s", check=check, stale=stale)
    return stale
