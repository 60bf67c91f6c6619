"""Offline checks of a KubeRay manifest, as strict as the API server with field validation.

The KubeRay CRDs come only from `$RAY_PLE_KUBERAY_CRDS` (never copied into the project). A
CRD schema is applied the way the API server applies it: nulls pruned, defaults filled in
before `required` is checked, and every object without `x-kubernetes-preserve-unknown-fields`
closed (`additionalProperties: false`), which is what `kubectl --validate=strict` does for
custom resources. Core objects go through `kubernetes-validate`'s strict schemas.
"""

from __future__ import annotations

import copy
import os
import typing
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from pydantic import BaseModel

CRDS_ENV = "RAY_PLE_KUBERAY_CRDS"
CRD_FILES = {"RayService": "ray.io_rayservices.yaml", "RayCluster": "ray.io_rayclusters.yaml"}
K8S_VERSIONS = ("1.29", "1.37")  # oldest and newest Kubernetes the manifests are checked for
UPGRADE_TYPES = ("NewCluster", "NewClusterWithIncrementalUpgrade", "None")
RESOURCE_PARAMS = ("num-cpus", "num-gpus", "memory", "resources")


def crd_dir() -> Path:
    raw = os.environ.get(CRDS_ENV)
    if not raw:
        pytest.fail(f"{CRDS_ENV} is not set: it must name the folder with the KubeRay CRDs "
                    f"({', '.join(CRD_FILES.values())}); .ci/run sets it")
    path = Path(raw)
    missing = [f for f in CRD_FILES.values() if not (path / f).is_file()]
    if missing:
        pytest.fail(f"{CRDS_ENV}={raw} has no {missing}")
    return path


@cache
def _crd_schema(path: str) -> dict[str, Any]:
    crd = yaml.safe_load(Path(path).read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return strictify(version["schema"]["openAPIV3Schema"])


def crd_schema(kind: str) -> dict[str, Any]:
    return _crd_schema(str(crd_dir() / CRD_FILES[kind]))


def strictify(schema: Any) -> Any:
    """Close every object the API server would prune unknown fields from."""
    if isinstance(schema, list):
        return [strictify(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strictify(v) for k, v in schema.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def _as_api_server(schema: dict[str, Any], value: Any) -> Any:
    """Prune non-nullable nulls and fill defaults, recursively (structural schemas only)."""
    if isinstance(value, dict) and "properties" in schema:
        props = schema["properties"]
        out = {k: v for k, v in value.items()
               if v is not None or props.get(k, {}).get("nullable")}
        for key, sub in props.items():
            if key not in out and "default" in sub:
                out[key] = copy.deepcopy(sub["default"])
            if key in out:
                out[key] = _as_api_server(sub, out[key])
        return out
    if isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        return {k: _as_api_server(schema["additionalProperties"], v) for k, v in value.items()}
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_as_api_server(schema["items"], v) for v in value]
    return value


def crd_errors(doc: dict[str, Any]) -> list[str]:
    """Every way `doc` breaks its KubeRay CRD (empty: the API server accepts it)."""
    schema = crd_schema(doc["kind"])
    instance = _as_api_server(schema, doc)
    validator = jsonschema.Draft7Validator(schema)
    return sorted(f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
                  for e in validator.iter_errors(instance))


def pod_templates(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    cluster = doc["spec"]["rayClusterConfig"] if doc["kind"] == "RayService" else doc["spec"]
    out = {"head": cluster["headGroupSpec"]["template"]}
    for group in cluster.get("workerGroupSpecs", []):
        out[group["groupName"]] = group["template"]
    return out


def core_errors(doc: dict[str, Any]) -> list[str]:
    """The pod templates (and the object's metadata) against Kubernetes' own strict schemas."""
    import kubernetes_validate

    errors = []
    for name, template in pod_templates(doc).items():
        core = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": doc["metadata"],
                "template": template}
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(core, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                errors.append(f"{name} (k8s {version}): {exc.message} at "
                              f"{'/'.join(map(str, exc.absolute_path))}")
    return errors


def kuberay_rule_errors(doc: dict[str, Any]) -> list[str]:
    """The checks of KubeRay's validation.go that no schema states."""
    errors = []
    spec = doc["spec"]
    if doc["kind"] == "RayService":
        if not (spec.get("serveConfigV2") or "").strip():
            errors.append("serveConfigV2 is empty")
        kind = (spec.get("upgradeStrategy") or {}).get("type")
        if kind is not None and kind not in UPGRADE_TYPES:
            errors.append(f"upgradeStrategy.type {kind!r} not in {UPGRADE_TYPES}")
    cluster = spec["rayClusterConfig"] if doc["kind"] == "RayService" else spec
    groups = [("head", cluster["headGroupSpec"])] + [
        (g["groupName"], g) for g in cluster.get("workerGroupSpecs", [])]
    for name, group in groups:
        params = group.get("rayStartParams") or {}
        if "labels" in params:
            errors.append(f"{name}: rayStartParams.labels is rejected; use labels")
        if group.get("resources") and any(p in params for p in RESOURCE_PARAMS):
            errors.append(f"{name}: resources both in rayStartParams and resources")
        containers = group["template"]["spec"]["containers"]
        if not containers or not containers[0].get("image"):
            errors.append(f"{name}: the first container (the Ray container) needs an image")
        if name != "head":
            lo, hi = group["minReplicas"], group["maxReplicas"]
            if not lo <= group.get("replicas", lo) <= hi:
                errors.append(f"{name}: replicas outside [minReplicas, maxReplicas]")
    return errors


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def unknown_keys(model: type[BaseModel], data: Any, path: str = "",
                 by_field: dict[str, type[BaseModel]] | None = None) -> list[str]:
    """Keys `model` (and the models nested in its fields) does not know, recursively.

    Ray's own schemas ignore most unknown keys (a typo such as `num_replicaz` is silently
    dropped); `by_field` names a model for fields typed only as dicts.
    """
    if isinstance(data, list):
        return [k for i, d in enumerate(data)
                for k in unknown_keys(model, d, f"{path}[{i}]", by_field)]
    if not isinstance(data, dict):
        return []
    known = {f.alias or n: n for n, f in model.model_fields.items()} | {
        n: n for n in model.model_fields}
    dot = f"{path}." if path else ""
    found = [f"{dot}{k}" for k in data if k not in known]
    for key, value in data.items():
        if key not in known:
            continue
        sub = (by_field or {}).get(key)
        models = [sub] if sub is not None else _models_in(model.model_fields[known[key]].annotation)
        if len(models) == 1:
            found += unknown_keys(models[0], value, f"{dot}{key}", by_field)
    return found


def serve_unknown_keys(serve_config: dict[str, Any]) -> list[str]:
    """Unknown keys in a serve config, through Ray Serve's and Ray Serve LLM's own models."""
    from ray.llm._internal.common.placement import PlacementGroupConfig
    from ray.llm._internal.serve.core.configs.llm_config import ModelLoadingConfig
    from ray.serve.schema import DeploymentSchema, ServeDeploySchema

    found = unknown_keys(ServeDeploySchema, serve_config)
    llm_fields = {"deployment_config": DeploymentSchema, "ingress_deployment_config":
                  DeploymentSchema, "placement_group_config": PlacementGroupConfig,
                  "model_loading_config": ModelLoadingConfig}
    from ray.serve.llm import LLMConfig

    for i, app in enumerate(serve_config.get("applications") or []):
        args = app.get("args") or {}
        for j, entry in enumerate(args.get("llm_configs") or []):
            entry = {k: v for k, v in entry.items() if k != "ple"}
            found += unknown_keys(LLMConfig, entry, f"applications[{i}].llm_configs[{j}]",
                                  llm_fields)
        if args.get("ingress_deployment_config"):
            found += unknown_keys(DeploymentSchema, args["ingress_deployment_config"],
                                  f"applications[{i}].ingress_deployment_config")
    return found
