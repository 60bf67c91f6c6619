"""The KubeRay manifests in k8s/, checked offline: generated, schema-valid, and big enough.

One test per row of the issue: generated from serve_configs/ (no drift), the KubeRay CRDs
(strict), Kubernetes' core schemas, KubeRay's own rules, serveConfigV2 through Ray Serve's
schema and ray-ple's args, and the resource arithmetic (requests >= what the app will use).
"""

from __future__ import annotations

import copy
import math
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from ray_ple.tools.cli import main as cli
from ray_ple.tools.k8s.render import README_BEGIN, README_END, render_all, serve_config_v2
from ray_ple.tools.k8s.sizing import group_name, ingress_demand, model_demands
from ray_ple.tools.k8s.spec import ManifestSpec, load_spec
from ray_ple.tools.quantity import parse_bytes, parse_quantity
from tests.k8s_schema import (
    CRDS_ENV,
    core_errors,
    crd_dir,
    crd_errors,
    kuberay_rule_errors,
    serve_unknown_keys,
)

ROOT = Path(__file__).resolve().parents[1]
SPECS = {m.file: m for m in load_spec(ROOT).manifests}


def _doc(file: str) -> dict[str, Any]:
    docs = [d for d in yaml.safe_load_all((ROOT / "k8s" / file).read_text()) if d]
    assert [d["kind"] for d in docs] == ["RayService"], file
    return docs[0]


def _serve_config(doc: dict[str, Any]) -> dict[str, Any]:
    return yaml.safe_load(doc["spec"]["serveConfigV2"])


@pytest.fixture(params=sorted(SPECS), name="manifest")
def _manifest(request) -> tuple[ManifestSpec, dict[str, Any]]:
    return SPECS[request.param], _doc(request.param)


def test_every_manifest_is_generated_from_serve_configs():
    rendered = render_all(ROOT)
    assert sorted(p.name for p in rendered) == sorted([*SPECS, "README.md"])
    for path, text in rendered.items():
        assert path.read_text() == text, f"{path.name} is stale: run `ray-ple render-k8s`"


def test_render_check_passes_from_any_directory(tmp_path, monkeypatch, capsys):
    """`ray-ple render-k8s --check` (what CI runs through this test), from a directory outside
    the checkout: it finds the checkout it runs from and the committed files are current."""
    monkeypatch.chdir(tmp_path)
    assert cli(["render-k8s", "--check"]) == 0, capsys.readouterr()
    assert capsys.readouterr().out == ""


def test_render_without_a_spec_says_so_once(tmp_path, capsys):
    assert cli(["render-k8s", "--check", "--root", str(tmp_path)]) == 2
    out = capsys.readouterr()
    assert "k8s/spec/clusters.yaml not found in" in out.err and "--root" in out.err
    assert "Traceback" not in out.err + out.out


def _copy_tree(tmp_path: Path) -> Path:
    """What `render-k8s` reads and writes, copied: the repository is never edited."""
    for part in ("k8s", "serve_configs"):
        shutil.copytree(ROOT / part, tmp_path / part)
    return tmp_path


def _readme_block(text: str) -> str:
    return text[text.index(README_BEGIN):text.index(README_END)]


@pytest.mark.parametrize("file, inside", [
    ("README.md", _readme_block),
    ("rayservice-gemma4-e4b-gpu.yaml", lambda text: text[:text.index("\n---\n")]),
])
def test_render_check_fails_on_a_stale_figure(tmp_path, capsys, file, inside):
    """A figure the sizing code did not give, in the README's sizing table or a manifest's
    header, fails `render-k8s --check` and names the file; `render-k8s` rewrites it."""
    root = _copy_tree(tmp_path)
    path = root / "k8s" / file
    text = path.read_text()
    region = inside(text)
    figure = re.search(r"\d+\.\d\d MiB", region)
    assert figure, f"no MiB figure in {file}'s generated part"
    stale = region.replace(figure[0], "168.00 MiB", 1)
    path.write_text(text.replace(region, stale, 1))
    assert cli(["render-k8s", "--check", "--root", str(root)]) == 1
    out = capsys.readouterr()
    assert out.out.splitlines() == [f"differs: k8s/{file}"]
    assert cli(["render-k8s", "--root", str(root)]) == 0
    assert path.read_text() == text
    assert cli(["render-k8s", "--check", "--root", str(root)]) == 0


DOCKERFILES = sorted((ROOT / "docker").glob("Dockerfile.*"))


def _dockerfile(path: Path) -> dict[str, Any]:
    """FROM, the ENV it sets, its COPY sources and its RUN steps."""
    out: dict[str, Any] = {"from": [], "env": {}, "copy": [], "run": []}
    for line in path.read_text().splitlines():
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        op, args = words[0].upper(), words[1:]
        if op == "FROM":
            out["from"].append(args[0])
        elif op == "ENV":
            out["env"].update(a.split("=", 1) for a in args)
        elif op == "COPY":
            out["copy"] += [a for a in args[:-1] if not a.startswith("--")]
        elif op == "RUN":
            out["run"].append(" ".join(args))
    return out


def test_dockerfiles_are_the_install_script():
    """Each image the README builds runs `scripts/install.sh` (its only RUN) with the extra the
    README names, into the base image's Python, on the Ray and Python of the manifests; its tag
    is the `image` of the manifests whose transport its first extra serves."""
    import tomllib

    readme = (ROOT / "k8s" / "README.md").read_text()
    builds = re.findall(r"docker build -f (\S+) -t (\S+) \.\s+# \w+: RAY_PLE_EXTRAS=(\S+)",
                        readme)
    assert sorted(ROOT / f for f, _, _ in builds) == DOCKERFILES and len(DOCKERFILES) == 2
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    images: dict[str, set[str]] = {}
    for spec in SPECS.values():
        app = _serve_config(_doc(spec.file))["applications"][0]
        for demand in model_demands(app, spec.checkpoint_configs):
            images.setdefault(spec.image, set()).add(demand.transport)
    for file, tag, extras in builds:
        image = _dockerfile(ROOT / file)
        assert image["run"] == ["scripts/install.sh"], file
        assert image["env"]["RAY_PLE_EXTRAS"] == extras, file
        assert set(extras.split(",")) <= set(project["optional-dependencies"]), file
        assert image["env"]["RAY_PLE_VENV"] == "/home/ray/anaconda3", file  # the base's Python
        ray = {s.ray_version for s in SPECS.values()}.pop()
        transport = extras.split(",")[0]  # the engine's extra first, then `media`
        flavour = "cpu" if transport == "cpu" else "cu128"
        assert image["from"] == [f"rayproject/ray:{ray}-py311-{flavour}"], file
        assert images.get(tag) == {transport}, f"{file}: {tag} serves {images.get(tag)}"
        # what `pip install -e .` and the script need from the build context
        needed = {"pyproject.toml", project["readme"], "ray_ple", "scripts"}
        assert needed <= set(image["copy"]), f"{file} copies {image['copy']}"
    assert {t for _, t, _ in builds} == set(images)


def test_serve_config_v2_is_the_serve_config(manifest):
    spec, doc = manifest
    source = yaml.safe_load((ROOT / spec.serve_config).read_text())
    embedded = _serve_config(doc)
    assert embedded["applications"] == source["applications"]
    assert embedded == serve_config_v2(source)
    assert embedded["http_options"] == {**source.get("http_options", {}), "host": "0.0.0.0",
                                        "port": 8000}


def test_crd_folder_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(CRDS_ENV, raising=False)
    with pytest.raises(pytest.fail.Exception, match=CRDS_ENV):
        crd_dir()


def test_rayservice_matches_the_kuberay_crd(manifest):
    assert crd_errors(manifest[1]) == []


@pytest.mark.parametrize("where, key", [
    (("spec",), "serveConfigv2"),
    (("spec", "rayClusterConfig", "workerGroupSpecs", 0), "replicaz"),
    (("spec", "rayClusterConfig", "headGroupSpec", "template", "spec", "containers", 0),
     "resourcez"),
    (("spec", "upgradeStrategy"), "typ"),
])
def test_crd_check_rejects_unknown_keys(where, key):
    doc = copy.deepcopy(_doc("rayservice-tiny-cpu.yaml"))
    node = doc
    for step in where:
        node = node[step]
    node[key] = node.get(key, "x")
    assert any(f"'{key}' was unexpected" in e for e in crd_errors(doc))


def test_crd_check_applies_defaults_and_required():
    doc = copy.deepcopy(_doc("rayservice-tiny-cpu.yaml"))
    group = doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    del group["minReplicas"], group["maxReplicas"]  # defaulted by the API server: still valid
    assert crd_errors(doc) == []
    del group["template"]
    assert any("'template' is a required property" in e for e in crd_errors(doc))


def test_pod_templates_match_kubernetes_schemas(manifest):
    assert core_errors(manifest[1]) == []


def test_core_check_rejects_a_bad_pod_template():
    doc = copy.deepcopy(_doc("rayservice-tiny-cpu.yaml"))
    worker = doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]
    worker["volumes"][0]["emptyDir"]["sizeLimt"] = "1Gi"
    assert any("sizeLimt" in e for e in core_errors(doc))


def test_kuberay_rules(manifest):
    assert kuberay_rule_errors(manifest[1]) == []


def test_serve_config_v2_through_ray_serve_and_ray_ple(manifest):
    from ray.serve.schema import ServeDeploySchema

    from ray_ple.serve.builder import validate_args

    config = _serve_config(manifest[1])
    ServeDeploySchema.model_validate(config)
    assert serve_unknown_keys(config) == []
    for app in config["applications"]:
        assert app["import_path"] == "ray_ple.serve:build_app"
        pairs = validate_args(app["args"])  # PleAppArgs, PleConfig, LLMConfig; no checkpoint
        assert pairs and all(ple.enabled for _, ple in pairs)


@pytest.mark.parametrize("path, key", [
    ((), "http_optionz"),
    (("applications", 0), "import_pat"),
    (("applications", 0, "args", "llm_configs", 0, "deployment_config"), "num_replicaz"),
    (("applications", 0, "args", "llm_configs", 0, "deployment_config", "ray_actor_options"),
     "num_cpuz"),
    (("applications", 0, "args", "llm_configs", 0, "placement_group_config"), "stratgy"),
])
def test_serve_config_check_rejects_unknown_keys(path, key):
    config = _serve_config(_doc("rayservice-tiny-cpu.yaml"))
    node = config
    for step in path:
        node = node[step]
    node[key] = 1
    assert any(found.endswith(key) for found in serve_unknown_keys(config))


@pytest.mark.parametrize("mutate, match", [
    (lambda e: e["ple"].update(offload_cpus=2), "offload_cpus"),
    (lambda e: e["engine_kwargs"].update(no_such_engine_arg=1), "no_such_engine_arg"),
    (lambda e: e["engine_kwargs"].update(pipeline_parallel_size=2), "tensor parallelism"),
    (lambda e: e["ple"].update(transport="cuda"), "does not fit"),
])
def test_serve_config_v2_args_rejected_without_a_checkpoint(mutate, match):
    from ray_ple.serve.builder import validate_args

    args = _serve_config(_doc("rayservice-tiny-cpu.yaml"))["applications"][0]["args"]
    mutate(args["llm_configs"][0])
    with pytest.raises(Exception, match=match):
        validate_args(args)


def test_embedded_model_is_budgeted_with_its_real_geometry():
    """The tiny model's table is sized from its preset; the built checkpoint must agree."""
    from ray_ple.checkpoints.source import resolve
    from ray_ple.protocol.geometry import geometry_from_config, read_hf_config

    spec = SPECS["rayservice-tiny-cpu.yaml"]
    app = _serve_config(_doc(spec.file))["applications"][0]
    demand = model_demands(app, spec.checkpoint_configs)[0]
    real = geometry_from_config(read_hf_config(resolve(demand.model_source)), max_tokens=1,
                                engine_dtype="bfloat16")
    assert demand.table_bytes == sum(4096 + g.table_bytes for g in real.tables)


def _cpu(value: Any) -> float:
    return parse_quantity(str(value))


def resource_violations(spec: ManifestSpec, doc: dict[str, Any]) -> list[str]:
    """Where the manifest's pods hold less than its own serveConfigV2 will use."""
    est = spec.workers.estimates
    app = _serve_config(doc)["applications"][0]
    ingress = ingress_demand(app)
    cluster = doc["spec"]["rayClusterConfig"]
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    bad = []
    if cluster["headGroupSpec"]["rayStartParams"].get("num-cpus") != "0":
        bad.append("head: replicas could land on the head (num-cpus must be 0)")
    if ingress.max_replicas > sum(g["minReplicas"] for g in groups.values()):
        bad.append("fewer worker pods than ingress replicas")
    for demand in model_demands(app, spec.checkpoint_configs):
        g = groups.get(group_name(demand.model_id))
        if g is None:
            bad.append(f"{demand.model_id}: no worker group")
            continue
        r = spec.workers.replicas_per_pod
        workers = r * demand.world_size
        params = g["rayStartParams"]
        pod = g["template"]["spec"]
        main = pod["containers"][0]
        req, lim = main["resources"]["requests"], main["resources"].get("limits", {})
        name = g["groupName"]
        if float(params["num-cpus"]) < r * demand.replica_cpus + ingress.cpus:
            bad.append(f"{name}: Ray CPUs {params['num-cpus']} < {r} x "
                       f"{demand.replica_cpus} + ingress {ingress.cpus}")
        gpus = int(params.get("num-gpus", "0"))
        if gpus < r * demand.replica_gpus:
            bad.append(f"{name}: {gpus} GPUs < {r} x {demand.replica_gpus}")
        if str(gpus) != str(lim.get("nvidia.com/gpu", "0")) and (gpus or
                                                                 "nvidia.com/gpu" in lim):
            bad.append(f"{name}: num-gpus {gpus} != container nvidia.com/gpu limit")
        for bundle in demand.bundles:
            if bundle.get("CPU", 0) > float(params["num-cpus"]) or bundle.get("GPU", 0) > gpus:
                bad.append(f"{name}: bundle {bundle} does not fit one pod")
        if g["maxReplicas"] * r < demand.max_replicas:
            bad.append(f"{name}: {g['maxReplicas']} pods cannot hold {demand.max_replicas} "
                       "replicas")
        if g["minReplicas"] * r < demand.min_replicas:
            bad.append(f"{name}: {g['minReplicas']} pods cannot hold {demand.min_replicas} "
                       "replicas")
        cores = (float(params["num-cpus"]) + r * est.unbooked_cores_per_replica
                 + est.system_cores)
        if _cpu(req["cpu"]) < cores:
            bad.append(f"{name}: container CPU {req['cpu']} < {cores}")
        object_store = int(params["object-store-memory"])
        shm_need = (demand.table_bytes + workers * demand.pair_bytes + object_store
                    + parse_bytes(est.shm_headroom))
        dshm = [v for v in pod["volumes"] if v["name"] == "dshm"]
        mounted = [m for m in main["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        if not dshm or not mounted or dshm[0]["emptyDir"].get("medium") != "Memory":
            bad.append(f"{name}: no memory-backed /dev/shm mounted")
            continue
        shm = parse_bytes(dshm[0]["emptyDir"]["sizeLimit"])
        if shm < shm_need:
            bad.append(f"{name}: /dev/shm {shm} < {shm_need}")
        processes = (workers * (parse_bytes(est.engine_host_per_worker)
                                + parse_bytes(est.offload_actor) + demand.weight_offload_bytes)
                     + r * demand.kv_host_bytes + parse_bytes(est.system))
        memory = parse_bytes(req["memory"])
        if memory < shm + processes:
            bad.append(f"{name}: memory {req['memory']} < /dev/shm {shm} + processes "
                       f"{processes}")
        if lim.get("memory") != req["memory"]:
            bad.append(f"{name}: memory limit != request")
        # Ray's memory monitor kills a worker once the pod's used memory passes its threshold;
        # the table, the slots and the processes must stay below it (k8s/README.md)
        env = {e["name"]: e.get("value") for e in main.get("env", [])}
        threshold = float(env.get("RAY_memory_usage_threshold") or 0.95)
        steady = demand.table_bytes + workers * demand.pair_bytes + processes
        if steady > threshold * memory:
            bad.append(f"{name}: table, slots and processes ({steady}) above Ray's memory "
                       f"monitor threshold {threshold} x {memory}")
        doctor = next((c for c in pod.get("initContainers", [])
                       if c["name"] == "ray-ple-doctor"), None)
        if doctor is None:
            bad.append(f"{name}: no ray-ple doctor init container")
            continue
        cmd = doctor["command"]
        flags = dict(zip(cmd[2::2], cmd[3::2]))
        expect = {"--transport": demand.transport, "--pair-bytes": str(demand.pair_bytes),
                  "--workers": str(workers), "--object-store-bytes": str(object_store)}
        bad += [f"{name}: doctor {k} {flags.get(k)} != {v}" for k, v in expect.items()
                if flags.get(k) != v]
        if int(flags.get("--table-bytes", 0)) < demand.table_bytes:
            bad.append(f"{name}: doctor --table-bytes below the table")
        if demand.transport == "cuda" and flags.get("--checkpoint") != demand.model_source:
            bad.append(f"{name}: doctor does not check the real checkpoint")
        if doctor["resources"] != main["resources"] or doctor["volumeMounts"] != \
                main["volumeMounts"]:
            bad.append(f"{name}: doctor sees other resources or mounts than the worker")
    return bad


def test_pods_hold_what_the_app_will_use(manifest):
    assert resource_violations(*manifest) == []


def test_gpu_pod_budgets_one_offload_actor_and_the_table_per_gpu():
    spec = SPECS["rayservice-gemma4-e4b-gpu.yaml"]
    app = _serve_config(_doc(spec.file))["applications"][0]
    demand = model_demands(app, spec.checkpoint_configs)[0]
    ple = app["args"]["llm_configs"][0]["ple"]
    assert demand.transport == "cuda" and demand.replica_gpus == 1
    # Each GPU's bundle holds its offload actor's CPUs (plus the replica's 1 in bundle 0).
    assert demand.bundles == ({"CPU": ple["offload_num_cpus"] + 1.0, "GPU": 1.0},)
    # Gemma 4 E4B: 262,144 rows x (42 layers x 256) bf16 = 5.25 GiB, plus a header page.
    assert demand.table_bytes == 4096 + 262144 * 42 * 256 * 2
    # the slots for a full batch: layers 1-41 (`resident_layers: auto` keeps layer 0 in the
    # GPU worker on the cuda transport)
    assert 8192 * 41 * 256 * 2 < demand.pair_bytes < 8192 * 42 * 256 * 2


@pytest.mark.parametrize("mutate, match", [
    (lambda g: g["rayStartParams"].update({"num-cpus": "1"}), "Ray CPUs"),
    (lambda g: g["template"]["spec"]["volumes"][0]["emptyDir"].update(sizeLimit="64Mi"),
     "/dev/shm"),
    (lambda g: g["template"]["spec"]["containers"][0]["resources"]["requests"].update(
        memory="1Gi"), "memory"),
    (lambda g: g.update(maxReplicas=0, minReplicas=0, replicas=0), "pods cannot hold"),
    (lambda g: g["template"]["spec"].pop("initContainers"), "doctor"),
    (lambda g: g["template"]["spec"]["containers"][0].setdefault("env", []).append(
        {"name": "RAY_memory_usage_threshold", "value": "0.5"}), "memory monitor"),
])
def test_arithmetic_catches_an_undersized_pod(mutate, match):
    spec = SPECS["rayservice-gemma4-e4b-gpu.yaml"]
    doc = copy.deepcopy(_doc(spec.file))
    mutate(doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0])
    assert any(match in v for v in resource_violations(spec, doc))


def test_upgrade_strategy_and_autoscaling_follow_the_serve_config(manifest):
    spec, doc = manifest
    cluster = doc["spec"]["rayClusterConfig"]
    assert doc["spec"]["upgradeStrategy"]["type"] == spec.upgrade_strategy
    app = _serve_config(doc)["applications"][0]
    demand = model_demands(app, spec.checkpoint_configs)[0]
    assert cluster["enableInTreeAutoscaling"] == (demand.min_replicas != demand.max_replicas)
    group = cluster["workerGroupSpecs"][0]
    r = spec.workers.replicas_per_pod
    assert group["minReplicas"] == math.ceil(demand.min_replicas / r)
    assert group["maxReplicas"] == math.ceil(demand.max_replicas / r)


def _own_probes(doc: dict[str, Any]) -> list[str]:
    """Probes a manifest sets itself on any container of any group."""
    cluster = doc["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    return [f"{c['name']}.{k}" for g in groups for c in g["template"]["spec"]["containers"]
            for k in ("readinessProbe", "livenessProbe") if k in c]


@pytest.mark.parametrize("probe", [None, "readinessProbe"])
def test_kuberay_injects_the_pod_probes(manifest, probe):
    """KubeRay injects its raylet and Serve-proxy probes only into a container that sets none;
    engine readiness is the Serve application status KubeRay already waits for (k8s/README.md,
    "Readiness"), so no manifest sets a probe of its own, and one that did is caught."""
    _, doc = manifest
    doc = copy.deepcopy(doc)
    if probe is not None:
        worker = doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
        worker["template"]["spec"]["containers"][0][probe] = {"httpGet": {"path": "/-/healthz",
                                                                          "port": 8000}}
        assert _own_probes(doc) == [f"ray-worker.{probe}"]
    else:
        assert _own_probes(doc) == []
    readme = (ROOT / "k8s" / "README.md").read_text()
    assert "--for=condition=Ready" in readme and "## Readiness" in readme
