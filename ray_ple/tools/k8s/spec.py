"""`k8s/spec/clusters.yaml`: what a manifest needs that no serve config says.

Everything derivable (placement bundles, offload CPUs, table and slot bytes, KV cache on CPU,
replica counts) comes from the serve config; this file holds only the cluster's choices
(image, head size, upgrade strategy, volumes) and the estimates of process memory and
unbooked cores, each with its reason next to it in the YAML.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field

from ray_ple.base import Frozen

SPEC_PATH = Path("k8s") / "spec" / "clusters.yaml"


class HeadSpec(Frozen):
    """The head runs GCS, the dashboard, the Serve controller and the app's build task."""

    cpu: str = "2"
    memory: str = "8Gi"


class WorkerEstimates(Frozen):
    """Per worker pod; what no config can state (see the reasons in `k8s/spec/clusters.yaml`)."""

    engine_host_per_worker: str = Field(description="host RSS of the replica, EngineCore and "
                                        "worker processes, per engine worker")
    offload_actor: str = Field(description="host RSS of one offload actor, its table view aside")
    system: str = Field(description="raylet, agents, proxy and an ingress replica")
    object_store: str = Field(description="Ray's object store (in /dev/shm)")
    shm_headroom: str = Field(description="/dev/shm used by vLLM, torch and NCCL themselves")
    unbooked_cores_per_replica: float = Field(ge=0, description="cores of processes Ray books "
                                              "no CPU for (vLLM's GPU workers, EngineCore)")
    system_cores: float = Field(ge=0, description="cores for Ray's own daemons")


class WorkerSpec(Frozen):
    replicas_per_pod: int = Field(1, ge=1, description="LLM replicas one worker pod holds")
    estimates: WorkerEstimates
    tolerations: list[dict[str, Any]] = []
    node_selector: dict[str, str] = {}


class ModelsVolume(Frozen):
    """A read-only volume with the checkpoint: on the head (the build task reads its config)
    and on every worker."""

    claim_name: str
    mount_path: str


class ManifestSpec(Frozen):
    file: str = Field(description="output, relative to k8s/")
    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    serve_config: str = Field(description="relative to the project root")
    image: str
    ray_version: str = "2.60.0"
    upgrade_strategy: Literal["NewCluster", "None"] = "NewCluster"
    models_volume: ModelsVolume | None = None
    checkpoint_configs: dict[str, dict[str, Any]] = Field(
        {}, description="model_id -> the checkpoint's config.json numbers (budget only; the "
        "doctor checks the real checkpoint in the pod)")
    head: HeadSpec = HeadSpec()
    workers: WorkerSpec


class ClustersFile(Frozen):
    manifests: list[ManifestSpec] = Field(min_length=1)


def load_spec(root: Path) -> ClustersFile:
    return ClustersFile.model_validate(yaml.safe_load((root / SPEC_PATH).read_text()))
