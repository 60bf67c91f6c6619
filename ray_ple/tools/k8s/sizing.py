"""The resource arithmetic: what one worker pod must hold for its share of the app.

Per pod (one Ray node: its own /dev/shm and network namespace, so one PLE table copy):

    Ray CPUs      = replicas x sum(replica bundle CPUs) + ingress CPUs, rounded up
                    (bundles exactly as Ray Serve LLM builds them: engine bundles, each with its
                    offload actor's CPUs, the replica actor merged into bundle 0)
    container CPU = Ray CPUs + replicas x unbooked cores + system cores
    /dev/shm      = table + workers x pair segment + object store + headroom
    memory        = /dev/shm + workers x (engine processes + offload actor + CPU weight offload)
                    + replicas x KV cache in host memory (CPU engines) + system
    memlock       = one pair segment + a page, per GPU worker process (what it page-locks)

Everything but the estimates in `k8s/spec/clusters.yaml` comes from the serve config and the
checkpoint's geometry, through the same functions `build_app` uses.
"""

from __future__ import annotations

import math
import mmap
from typing import Any

from ray_ple.base import Frozen
from ray_ple.checkpoints.source import SCHEME
from ray_ple.checkpoints.tiny import PRESETS, architecture
from ray_ple.config import PleConfig
from ray_ple.engine_plan import slot_tokens
from ray_ple.errors import PleConfigError
from ray_ple.protocol.geometry import geometry_from_config
from ray_ple.protocol.layout import PairLayout
from ray_ple.tools.k8s.spec import WorkerEstimates
from ray_ple.tools.quantity import GiB, parse_bytes

SERVE_DEFAULT_NUM_CPUS = 1.0  # a Serve replica's CPUs when ray_actor_options says none


class ModelDemand(Frozen):
    """One model of the app: one replica's placement group and its host memory."""

    model_id: str
    model_source: str
    transport: str  # "cpu" | "cuda" | "none" (offload disabled)
    dtype: str
    world_size: int
    bundles: tuple[dict[str, float], ...]
    strategy: str
    min_replicas: int
    max_replicas: int
    offload_cpus: float
    table_bytes: int  # the node copy's segment (header page + rows)
    tables: tuple[tuple[int, int], ...] = ()  # (rows, row bytes) of each offloaded table
    pair_bytes: int  # one worker's pair segment (control block, input slot, output slots)
    slot_tokens: int = 0  # rows of each output slot
    slot_row_bytes: int = 0  # one token's row across all output slots
    kv_host_bytes: int  # per replica: a CPU engine's KV cache lives in host memory
    weight_offload_bytes: int  # per worker: engine_kwargs.cpu_offload_gb

    @property
    def replica_cpus(self) -> float:
        return sum(b.get("CPU", 0.0) for b in self.bundles)

    @property
    def replica_gpus(self) -> float:
        return sum(b.get("GPU", 0.0) for b in self.bundles)


class IngressDemand(Frozen):
    cpus: float
    max_replicas: int


class PodBudget(Frozen):
    """One worker group's pod, with the terms it was summed from."""

    group: str
    model_id: str
    transport: str
    replicas_per_pod: int
    workers: int
    min_pods: int
    max_pods: int
    gpus: int
    ray_cpus: int
    cpu: float
    table_bytes: int
    pair_bytes: int
    object_store_bytes: int
    shm_headroom_bytes: int
    shm_bytes: int
    process_bytes: int
    system_bytes: int
    memory_bytes: int
    memlock_bytes: int

    def explain(self, demand: ModelDemand, ingress: IngressDemand,
                est: WorkerEstimates) -> list[str]:
        """The arithmetic in words, for the manifest's header."""
        from ray_ple.tools.quantity import human

        r, w = self.replicas_per_pod, self.workers
        lines = [
            (f'Worker pod "{self.group}": {r} replica(s) of {demand.model_id}, {w} engine '
             f"worker(s), {self.gpus} GPU(s), transport {self.transport}"),
            (f"  Ray CPUs {self.ray_cpus} >= {r} x replica bundles {demand.replica_cpus:g} "
             f"(offload actor {demand.offload_cpus:g} per worker) + ingress {ingress.cpus:g}"),
            (f"  container CPU {self.cpu:g} = Ray CPUs + {r} x unbooked "
             f"{est.unbooked_cores_per_replica:g} + system {est.system_cores:g}"),
            (f"  /dev/shm {human(self.shm_bytes)} = table {human(self.table_bytes)} + {w} x "
             f"pair {human(self.pair_bytes)} + object store {human(self.object_store_bytes)} "
             f"+ headroom {human(self.shm_headroom_bytes)}"),
            (f"  memory {human(self.memory_bytes)} >= /dev/shm + processes "
             f"{human(self.process_bytes)} + system {human(self.system_bytes)}"),
        ]
        if self.transport == "cuda":
            lines.append(f"  memlock per GPU worker: {human(self.memlock_bytes)} page-locked "
                         "(its pair segment; see k8s/README.md, memlock)")
        return lines


def _released(arch: str, layers: int) -> dict[str, Any]:
    return {"architectures": [arch], "text_config": {
        "num_hidden_layers": layers, "hidden_size_per_layer_input": 256,
        "vocab_size_per_layer_input": 262144, "vocab_size": 262144, "dtype": "bfloat16"}}


# The PLE tables of the released checkpoints, by directory name (bf16): used where the
# checkpoint is absent and k8s/spec/clusters.yaml declares no config (a declared one wins).
RELEASED_TABLES: dict[str, dict[str, Any]] = {
    "gemma-4-E4B": _released("Gemma4ForConditionalGeneration", 42),   # 5.25 GiB
    "gemma-3n-E4B": _released("Gemma3nForConditionalGeneration", 35),  # 4.38 GiB
    "gemma-3n-E2B": _released("Gemma3nForConditionalGeneration", 30),  # 3.75 GiB
}


def _released_config(model_source: str) -> dict[str, Any] | None:
    name = model_source.rstrip("/").rsplit("/", 1)[-1]
    return next((cfg for prefix, cfg in RELEASED_TABLES.items() if name.startswith(prefix)),
                None)


def checkpoint_config(model_source: str, model_id: str,
                      declared: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The checkpoint's config.json numbers: the embedded models' own, or the declared ones."""
    if model_source.startswith(SCHEME):
        name = model_source[len(SCHEME):]
        if name not in PRESETS:
            raise PleConfigError(f"unknown embedded model {model_source!r}")
        s = PRESETS[name]
        return {"architectures": [architecture(s)], "dtype": "bfloat16",
                "num_hidden_layers": s.num_hidden_layers, "vocab_size": s.vocab_size,
                "vocab_size_per_layer_input": s.vocab_size_per_layer_input,
                "hidden_size_per_layer_input": s.hidden_size_per_layer_input}
    released = _released_config(model_source)
    if model_id not in declared and released is not None:
        return released
    if model_id not in declared:
        raise PleConfigError(f"k8s/spec/clusters.yaml gives no checkpoint_configs[{model_id!r}]: "
                             f"the checkpoint {model_source} is not here to read its table size")
    return declared[model_id]


def replica_bundles(llm: Any) -> list[dict[str, float]]:
    """One replica's placement group, merged exactly as `LLMServer.get_deployment_options`."""
    from ray.llm._internal.serve.core.server.llm_server import (
        _merge_replica_actor_and_child_actor_bundles,
    )

    opts = llm.deployment_config.get("ray_actor_options", {})
    replica = {"CPU": opts.get("num_cpus", 1), "GPU": opts.get("num_gpus", 0),
               **opts.get("resources", {})}
    if "memory" in opts:
        replica["memory"] = opts["memory"]
    merged = _merge_replica_actor_and_child_actor_bundles(
        llm.get_engine_config().placement_bundles, replica)
    return [{k: float(v) for k, v in b.items() if v} for b in merged]


def _replicas(deployment_config: dict[str, Any]) -> tuple[int, int]:
    auto = deployment_config.get("autoscaling_config")
    if auto:
        auto = auto if isinstance(auto, dict) else auto.model_dump()
        return int(auto.get("min_replicas", 1)), int(auto.get("max_replicas", 1))
    n = deployment_config.get("num_replicas", 1)
    if not isinstance(n, int):
        raise PleConfigError(f"num_replicas={n!r}: give a number or an autoscaling_config so "
                             "that pods can be sized")
    return n, n


def _kv_host_bytes(llm: Any, app_env: dict[str, str]) -> int:
    """A CPU engine keeps its KV cache in host memory; the pod must hold it."""
    if llm.accelerator_config.kind != "cpu":
        return 0
    explicit = llm.engine_kwargs.get("kv_cache_memory_bytes")
    if explicit is not None:
        return int(explicit)
    env = {**app_env, **((llm.runtime_env or {}).get("env_vars") or {})}
    space = env.get("VLLM_CPU_KVCACHE_SPACE")
    if space:
        return int(space) * GiB
    raise PleConfigError(f"{llm.model_loading_config.model_id}: a CPU engine in a pod needs an "
                         "explicit KV cache (VLLM_CPU_KVCACHE_SPACE or kv_cache_memory_bytes); "
                         "a fraction of memory cannot be budgeted")


def model_demands(app: dict[str, Any],
                  declared: dict[str, dict[str, Any]]) -> list[ModelDemand]:
    """Every model of one `applications[]` entry (args as `build_app` takes them)."""
    from ray_ple.serve.builder import validate_args

    app_env = ((app.get("runtime_env") or {}).get("env_vars")) or {}
    out = []
    for llm, ple in validate_args(app.get("args") or {}):
        out.append(_model_demand(llm, ple, app_env, declared))
    return out


def _model_demand(llm: Any, ple: PleConfig, app_env: dict[str, str],
                  declared: dict[str, dict[str, Any]]) -> ModelDemand:
    mlc = llm.model_loading_config
    source = mlc.model_source or mlc.model_id
    kw = llm.engine_kwargs
    world = int(kw.get("tensor_parallel_size", 1))
    table = pair = tokens = row_bytes = 0
    tables: tuple[tuple[int, int], ...] = ()
    transport, dtype = "none", str(kw.get("dtype", "auto"))
    if ple.enabled:
        if ple.shm_dir != "/dev/shm":
            raise PleConfigError(f"ple.shm_dir={ple.shm_dir}: the manifests size /dev/shm only")
        transport = "cpu" if llm.accelerator_config.kind == "cpu" else "cuda"
        geometry = geometry_from_config(checkpoint_config(source, mlc.model_id, declared),
                                        max_tokens=slot_tokens(ple, kw),
                                        engine_dtype=kw.get("dtype"), parts=ple.parts,
                                        resident_layers=ple.resident_layers,
                                        transport=transport)
        dtype = geometry.tables[0].dtype
        table = sum(mmap.PAGESIZE + g.table_bytes for g in geometry.tables)
        tables = tuple((g.rows, g.row_bytes) for g in geometry.tables)
        tokens, row_bytes = geometry.max_tokens, sum(s.row_bytes for s in geometry.slots())
        pair = PairLayout.compute(geometry.max_tokens,
                                  tuple(s.row_bytes for s in geometry.slots())).size
    lo, hi = _replicas(llm.deployment_config)
    pgc = llm.placement_group_config or {}
    return ModelDemand(
        model_id=mlc.model_id, model_source=source, transport=transport, dtype=dtype,
        world_size=world, bundles=tuple(replica_bundles(llm)),
        strategy=pgc.get("strategy", "PACK"), min_replicas=lo, max_replicas=hi,
        offload_cpus=ple.offload_num_cpus if ple.enabled else 0.0, table_bytes=table,
        tables=tables, pair_bytes=pair, slot_tokens=tokens, slot_row_bytes=row_bytes,
        kv_host_bytes=_kv_host_bytes(llm, app_env),
        weight_offload_bytes=int(float(kw.get("cpu_offload_gb", 0)) * GiB))


def ingress_demand(app: dict[str, Any]) -> IngressDemand:
    """The OpenAI ingress deployment: Serve's default CPU unless the app says otherwise."""
    cfg = (app.get("args") or {}).get("ingress_deployment_config") or {}
    cpus = (cfg.get("ray_actor_options") or {}).get("num_cpus")
    _, hi = _replicas(cfg)
    return IngressDemand(cpus=SERVE_DEFAULT_NUM_CPUS if cpus is None else float(cpus),
                         max_replicas=hi)


def group_name(model_id: str) -> str:
    name = "".join(c if c.isalnum() else "-" for c in model_id.lower()).strip("-")
    return name[:40] or "llm"


def pod_budget(demand: ModelDemand, ingress: IngressDemand, est: WorkerEstimates,
               replicas_per_pod: int) -> PodBudget:
    """One worker pod for `replicas_per_pod` replicas of `demand` (and one ingress replica)."""
    if demand.strategy not in ("STRICT_PACK", "PACK"):
        raise PleConfigError(f"{demand.model_id}: strategy {demand.strategy} spreads a replica "
                             "over pods; the manifests place each replica in one pod")
    r, workers = replicas_per_pod, replicas_per_pod * demand.world_size
    gpus = r * demand.replica_gpus
    if gpus != int(gpus):
        raise PleConfigError(f"{demand.model_id}: {gpus} GPUs per pod is not a whole number")
    object_store = parse_bytes(est.object_store)
    headroom = parse_bytes(est.shm_headroom)
    shm = demand.table_bytes + workers * demand.pair_bytes + object_store + headroom
    offload_rss = parse_bytes(est.offload_actor) if demand.transport != "none" else 0
    process = (workers * (parse_bytes(est.engine_host_per_worker) + offload_rss
                          + demand.weight_offload_bytes) + r * demand.kv_host_bytes)
    system = parse_bytes(est.system)
    ray_cpus = math.ceil(r * demand.replica_cpus + ingress.cpus)
    return PodBudget(
        group=group_name(demand.model_id), model_id=demand.model_id,
        transport=demand.transport, replicas_per_pod=r, workers=workers,
        min_pods=math.ceil(demand.min_replicas / r), max_pods=math.ceil(demand.max_replicas / r),
        gpus=int(gpus), ray_cpus=ray_cpus,
        cpu=ray_cpus + r * est.unbooked_cores_per_replica + est.system_cores,
        table_bytes=demand.table_bytes, pair_bytes=demand.pair_bytes,
        object_store_bytes=object_store, shm_headroom_bytes=headroom, shm_bytes=shm,
        process_bytes=process, system_bytes=system,
        memory_bytes=math.ceil((shm + process + system) / GiB) * GiB,
        memlock_bytes=demand.pair_bytes + mmap.PAGESIZE if demand.transport == "cuda" else 0,
    )
