"""The main job: `serve run serve_configs/ple.yaml` serves the OpenAI API with the offload.

The test config is the shipped one plus three things: the offloaded model gets two replicas
(they must share one host table), the same model is also served with `ple.enabled: false` as
the unoffloaded reference, and the tiny Gemma 3n of `serve_configs/gemma3n-tiny-cpu.yaml`
(multimodal layout, served as text) joins them, all in one run: one cluster start for all.
The fixture also watches that start: when `/v1/models` first answers, when Serve says the
application is RUNNING (the readiness signal the README documents), and when a completion
first succeeds.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import requests
import yaml

from ray_ple.checkpoints.tiny import PRESETS, build
from ray_ple.supervision.engine_leftovers import SHM_DIR, files_of, remove_unused
from ray_ple.tools.ready import app_status
from tests.hf_reference import hf_agrees
from tests.leftovers import ple_processes, ple_shm_entries
from tests.serving import (
    BASE,
    REPO,
    ServeRun,
    audio_part,
    child_env,
    complete,
    image_part,
    load_config,
    offload_pids,
    table_mappings,
)

pytestmark = pytest.mark.slow
PROMPTS = [[5, 6, 7, 8], [100, 101], [9, 30, 31, 32, 33, 34, 35, 36], [250, 4]]
MODELS = ("tiny-gemma4", "tiny-gemma4-plain", "tiny-gemma3n")
DASHBOARD = "http://127.0.0.1:8265"
# The README's readiness check, run as written (exit 0 only once the application is RUNNING)
READY_CHECK = ".venv/bin/ray-ple ready -n ple --timeout 600"
# as a user runs it: no RAY_* variable, so Ray 2.60's default token auth is on
AS_USER = {"RAY_AUTH_MODE": None}
SHORT_TIMEOUT_S = 15  # a one-token completion on a started replica, on 2 busy cores


class StartWatch:
    """Wall-clock times (time.time(), as `log_event`'s `ts`) of what an operator can see while
    the application starts: `/v1/models` answering, Serve's application status, completions."""

    def __init__(self) -> None:
        self.t0 = time.time()
        self.models_at: float | None = None
        self.check_done_at_models: bool | None = None  # had READY_CHECK exited by then?
        self.statuses: list[tuple[float, str | None]] = []
        self.running_at: float | None = None
        self.check: subprocess.Popen | None = None  # READY_CHECK, started with `serve run`
        self.check_exit: tuple[int, float] | None = None  # its status and when it ended
        self.sent_at_running: dict[str, tuple[int, float]] = {}  # model -> (status, seconds)
        self.first_ok_at: float | None = None  # the background prober's first 200
        self._stop = threading.Event()

    def probe(self) -> None:
        """Completions to the offloaded model, back to back, as a client would keep trying."""
        while not self._stop.is_set() and self.first_ok_at is None:
            with contextlib.suppress(requests.RequestException):
                r = requests.post(f"{BASE}/v1/completions", timeout=5, json={
                    "model": "tiny-gemma4", "prompt": "w5", "max_tokens": 1})
                if r.status_code == 200:
                    self.first_ok_at = time.time()
            self._stop.wait(1)

    def watch(self, run: ServeRun, timeout: float = 420) -> None:
        prober = threading.Thread(target=self.probe, daemon=True)
        prober.start()
        self.check = subprocess.Popen(["bash", "-c", READY_CHECK], cwd=REPO,
                                      env=child_env(AS_USER), stdout=subprocess.DEVNULL)
        try:
            while self.running_at is None:
                if time.time() - self.t0 > timeout:
                    raise TimeoutError(f"not RUNNING in {timeout}s: {run.log.read_text()[-4000:]}")
                if run.proc.poll() is not None:
                    raise RuntimeError(f"serve run exited: {run.log.read_text()[-4000:]}")
                if self.models_at is None:
                    with contextlib.suppress(requests.RequestException):
                        if requests.get(f"{BASE}/v1/models", timeout=2).status_code == 200:
                            self.models_at = time.time()
                            self.check_done_at_models = self.check.poll() is not None
                status = _app_status()
                self.statuses.append((time.time(), status))
                assert status != "DEPLOY_FAILED", run.log.read_text()[-4000:]
                if status == "RUNNING":
                    self.running_at = time.time()
                    for model in MODELS:  # sent when ready: each answers within a short time
                        t = time.monotonic()
                        r = requests.post(f"{BASE}/v1/completions", timeout=SHORT_TIMEOUT_S,
                                          json={"model": model, "prompt": "w5", "max_tokens": 1})
                        self.sent_at_running[model] = (r.status_code, time.monotonic() - t)
                time.sleep(0.5)
            code = self.check.wait(timeout=30)
            self.check_exit = (code, time.time())
        finally:
            self._stop.set()
            prober.join(10)
            if self.check.poll() is None:
                self.check.kill()

    def summary(self) -> dict[str, float | None]:
        """Seconds from `serve run` to each moment."""
        at = {"models_answer": self.models_at, "first_completion": self.first_ok_at,
              "app_running": self.running_at}
        return {k: None if v is None else round(v - self.t0, 1) for k, v in at.items()}


def _app_status() -> str | None:
    """The application's status as the dashboard's Serve API has it (with the cluster's
    token: the run has token auth on, as a user's)."""
    return app_status(DASHBOARD, "ple")[0]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    cfg = load_config()
    app = cfg["applications"][0]
    offload = app["args"]["llm_configs"][0]
    offload["deployment_config"]["num_replicas"] = 2
    plain = json.loads(json.dumps(offload))
    plain["model_loading_config"]["model_id"] = "tiny-gemma4-plain"
    plain["deployment_config"]["num_replicas"] = 1
    plain["ple"] = {"enabled": False}
    app["args"]["llm_configs"].append(plain)
    app["args"]["llm_configs"] += load_config("gemma3n-tiny-cpu.yaml")["applications"][0][
        "args"]["llm_configs"]
    # three replicas and the ingress on a 2-CPU machine: smaller logical CPU shares
    for llm in app["args"]["llm_configs"]:
        llm["placement_group_config"]["bundle_per_worker"] = {"CPU": 0.25}
        llm["deployment_config"]["ray_actor_options"] = {"num_cpus": 0.125}
    for llm in app["args"]["llm_configs"]:
        if llm.get("ple", {}).get("enabled", True):
            llm["ple"]["offload_num_cpus"] = 0.125
    app["args"]["ingress_deployment_config"] = {"ray_actor_options": {"num_cpus": 0.1}}
    tmp = tmp_path_factory.mktemp("serve")
    (tmp / "ple-test.yaml").write_text(yaml.safe_dump(cfg))
    run = ServeRun(tmp / "ple-test.yaml", tmp / "serve.log", env=AS_USER)
    run.start = StartWatch()
    try:
        run.start.watch(run)
        for model in MODELS:
            run.wait_ready(model)
        yield run
    finally:
        run.stop()


def test_ready_only_when_serve_says_running(served):
    """Serve's application status is the readiness signal: it says RUNNING only after every
    offloaded replica's `start()` returned (pairs built and attached, engine started: the
    `replica_ready` events), while `/v1/models` answers well before; a completion sent to each
    model once it says RUNNING succeeds within a short timeout. The README's check, run as
    written from the moment `serve run` starts, with no RAY_* variable (Ray's default token
    auth on), is still waiting while `/v1/models` already answers and exits 0 at RUNNING."""
    start: StartWatch = served.start
    ready = [e["ts"] for e in _logged(served.log.read_text(), "replica_ready")]
    print(f"start: {start.summary()}, replica_ready at "
          f"{sorted(round(t - start.t0, 1) for t in ready)}")
    assert len(ready) == 3, "two Gemma 4 replicas and one Gemma 3n replica"
    assert [s for t, s in start.statuses if t < max(ready)] and \
        all(s != "RUNNING" for t, s in start.statuses if t < max(ready)), start.statuses
    assert start.running_at >= max(ready)
    assert start.sent_at_running == {m: (200, start.sent_at_running[m][1]) for m in MODELS}
    assert all(s < SHORT_TIMEOUT_S for _, s in start.sent_at_running.values())
    # the gap: the ingress lists the models before any replica can serve
    assert start.models_at is not None and start.models_at < min(ready)
    assert start.check_done_at_models is False
    code, ended = start.check_exit
    assert code == 0 and max(ready) <= ended <= start.running_at + 10, (code, ended)
    assert start.first_ok_at is None or start.first_ok_at >= min(ready)
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert READY_CHECK in readme, "the README documents the check this test runs"


def test_models_listed(served):
    ids = {m["id"] for m in requests.get(f"{BASE}/v1/models", timeout=30).json()["data"]}
    assert {"tiny-gemma4", "tiny-gemma4-plain", "tiny-gemma3n"} <= ids


def test_completions_identical_to_unoffloaded_and_hf(served):
    got = [complete("tiny-gemma4", p)["choices"][0]["token_ids"] for p in PROMPTS]
    ref = [complete("tiny-gemma4-plain", p)["choices"][0]["token_ids"] for p in PROMPTS]
    assert got == ref
    problems, near_ties = hf_agrees(str(build(PRESETS["tiny-gemma4"])), PROMPTS, got)
    assert problems == [] and near_ties <= 3


def test_chat_and_streaming(served):
    body = {"messages": [{"role": "user", "content": "w5 w6 w7"}], "max_tokens": 6,
            "temperature": 0, "ignore_eos": True}
    chat = {m: requests.post(f"{BASE}/v1/chat/completions", timeout=60,
                             json={"model": m, **body}).json()["choices"][0]["message"]["content"]
            for m in ("tiny-gemma4", "tiny-gemma4-plain")}
    assert chat["tiny-gemma4"] == chat["tiny-gemma4-plain"] and chat["tiny-gemma4"].strip()

    whole = complete("tiny-gemma4", "w5 w6 w7 w8", return_token_ids=False)["choices"][0]["text"]
    r = requests.post(f"{BASE}/v1/completions", timeout=60, stream=True, json={
        "model": "tiny-gemma4", "prompt": "w5 w6 w7 w8", "max_tokens": 8, "temperature": 0,
        "ignore_eos": True, "stream": True})
    chunks = [json.loads(line[6:]) for line in r.iter_lines(decode_unicode=True)
              if line and line.startswith("data: ") and line != "data: [DONE]"]
    # Ray Serve LLM batches stream chunks by time: under load 8 tokens may come in fewer pieces
    assert len(chunks) >= 2, chunks
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole


def test_the_applications_env_vars_reach_every_engine(served):
    """`runtime_env.env_vars` of the application (ple.yaml: `VLLM_CPU_KVCACHE_SPACE`) are in
    every engine worker's environment, offloaded or not; ray-ple's own are added, not swapped
    in (Ray Serve LLM lays a model's `runtime_env` over the application's key by key)."""
    app_env = load_config()["applications"][0]["runtime_env"]["env_vars"]
    workers = {}
    for p in psutil.Process(served.proc.pid).children(recursive=True):  # this run's only
        with contextlib.suppress(psutil.Error):
            if p.name() == "VLLM::Worker":
                workers[p.pid] = p.environ()
    offloaded = [pid for pid, env in workers.items() if "RAY_PLE_PAIRS" in env]
    assert len(offloaded) == 3 and len(workers) == 4, workers.keys()  # 2 + gemma3n; plain
    for pid, env in workers.items():
        assert {k: env.get(k) for k in app_env} == app_env, (pid, pid in offloaded)
        if pid in offloaded:
            assert env.get("VLLM_USE_V2_MODEL_RUNNER") == "0"


def test_two_replicas_share_one_host_table(served):
    pids = offload_pids()
    assert len(pids) == 3, "one offload actor per replica (one engine worker each)"
    by_table: dict[frozenset, list[int]] = {}
    for pid in pids:
        by_table.setdefault(frozenset(table_mappings(pid)), []).append(pid)
    assert all(by_table), "every offload actor maps a node table"
    assert sorted(len(p) for p in by_table.values()) == [1, 2], \
        "the two Gemma 4 replicas map one table segment; the Gemma 3n replica its own"


def _logged(log: str, event: str) -> list[dict]:
    """Every `log_event` line of `event` in `serve run`'s output (actors' lines carry a
    Ray prefix before the JSON)."""
    tag = '{"ray_ple":"' + event + '"'
    return [json.loads(line[line.index(tag):]) for line in log.splitlines() if tag in line]


def test_doctor_figures_equal_what_the_server_logs(served):
    """`ray-ple doctor --config` on this very config: its table rows, pair segments and slot
    tokens are the ones the builder, the table loaders and the offload actors log."""
    import re

    config = served.log.parent / "ple-test.yaml"
    out = subprocess.run([sys.executable, "-m", "ray_ple.tools.cli", "doctor", "--config",
                          str(config)], check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    table = next(x for x in out.stdout.splitlines() if x.startswith("PASS table: "))
    fig = re.compile(r"^(\S+): table \S+ \[\d+, \d+\] \w+ (\d+) B .*slots (\d+) tokens .*"
                     r"pair segment (\d+) B; transport \w+, (\d+) replica")
    doctor = {m[1]: (int(m[2]), int(m[3]), int(m[4]), int(m[5])) for m in (
        fig.match(part) for part in table[len("PASS table: "):].split(" | "))}
    assert set(doctor) == {"tiny-gemma4", "tiny-gemma3n"}, table
    log = served.log.read_text()
    built = {e["model_id"]: (e["table_bytes"], e["max_tokens"])
             for e in _logged(log, "build_model") if e["offload"]}
    assert built == {k: v[:2] for k, v in doctor.items()}, (built, doctor)
    held = sorted(e["bytes"] for e in _logged(log, "table_hold"))
    pairs = sorted(e["segment_bytes"] for e in _logged(log, "offload_ready"))
    # one table per model on the node (the 2 replicas share theirs), one pair per replica
    assert sorted(set(held)) == sorted(v[0] for v in doctor.values()), held
    assert pairs == sorted(v[2] for v in doctor.values() for _ in range(v[3])), pairs


# Images and audio: the models are served as text; a request with media is refused (400)
MEDIA = {"image": lambda: image_part((200, 30, 30)), "audio": lambda: audio_part(None)}
MEDIA_MODELS = ["tiny-gemma4", "tiny-gemma3n"]


def test_gemma3n_served_offloaded_agrees_with_hf(served):
    prompts = [[5, 6, 7, 8], [9, 30, 31, 200, 201, 255]]
    got = [complete("tiny-gemma3n", p)["choices"][0]["token_ids"] for p in prompts]
    # the multimodal layout holds the same weights as the text preset HF loads
    problems, near_ties = hf_agrees(str(build(PRESETS["tiny-gemma3n"])), prompts, got)
    assert problems == [] and near_ties <= 2


@pytest.mark.parametrize("model", MEDIA_MODELS)
@pytest.mark.parametrize("media", sorted(MEDIA))
def test_a_request_with_media_is_refused_and_the_replica_keeps_serving(served, model, media):
    before = sorted(offload_pids())
    body = {"model": model, "max_tokens": 4, "temperature": 0, "messages": [{
        "role": "user", "content": [{"type": "text", "text": "w5 w6"}, MEDIA[media]()]}]}
    r = requests.post(f"{BASE}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert "multimodal" in r.json()["error"]["message"].lower(), r.text
    assert complete(model, [5, 6, 7])["choices"][0]["token_ids"], "still serving"
    assert sorted(offload_pids()) == before, "no replica was replaced"


REPORT_INTERVAL_S = 10  # Ray's RAY_metrics_report_interval_ms default: a worker's report


def _metrics_targets(run: ServeRun) -> list[str]:
    """The metrics endpoints of this run's own cluster, found as `ray metrics
    launch-prometheus`'s Prometheus finds them: the service-discovery file Ray writes in its
    session directory (the session named on this run's processes' command lines, never
    another cluster's). Each node's metrics export port is chosen at start (the command
    lines say `--metrics-export-port=0`), so only Ray's own record names it."""
    import re

    sessions = set()
    for proc in psutil.Process(run.proc.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            sessions |= set(re.findall(r"--session[-_]dir=(\S+)", " ".join(proc.cmdline())))
    assert len(sessions) == 1, f"this run's session directory: {sessions}"
    (session,) = sessions
    sd = json.loads((Path(session) / "prom_metrics_service_discovery.json").read_text())
    return [t for group in sd for t in group["targets"]]


def _scrape(targets: list[str]) -> str:
    """Every target's /metrics, one text (a target that does not answer adds nothing)."""
    texts = []
    for target in targets:
        with contextlib.suppress(requests.RequestException):
            texts.append(requests.get(f"http://{target}/metrics", timeout=10).text)
    return "\n".join(texts)


def _series(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample of `name` (exactly that name) in a scrape."""
    import re

    out = []
    for labels, value in re.findall(rf"^{name}\{{(.*)\}} (\S+)$", text, re.M):
        out.append((dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', labels)), float(value)))
    return out


def test_every_metric_the_dashboard_queries_is_exported(served):
    """After a few completions, the metrics endpoints of the serve run's cluster (found
    through Ray's service-discovery file) export every name the Grafana dashboard queries,
    exactly (`ray_ple_*`, never `ray_ray_ple_*`); for each offloaded replica, the deadline
    counter of every kind and the verdict counter of every reason are there at 0 (nothing
    missed, nothing ended), and a phase series for every part of every rank."""
    from ray_ple.protocol.fatal import Reason
    from ray_ple.supervision import metrics
    from ray_ple.supervision.supervisor import _DEADLINES
    from tests.test_dashboard import dashboard_metrics

    for prompt in PROMPTS:
        for model in ("tiny-gemma4", "tiny-gemma3n"):
            complete(model, prompt)
    targets = _metrics_targets(served)
    wanted, found, text = dashboard_metrics(), set(), ""
    deadline = time.monotonic() + 4 * REPORT_INTERVAL_S  # reported within one interval
    while found != wanted and time.monotonic() < deadline:
        text = _scrape(targets)
        found = {n for n in wanted if _series(text, n)}
        time.sleep(2)
    assert found == wanted, f"not exported from {targets}: {sorted(wanted - found)}"
    assert "ray_ray_" not in text
    ready = {e["replica"] for e in _logged(served.log.read_text(), "replica_ready")}
    assert len(ready) == 3, ready
    for name, key, values in (
            ("ray_" + metrics.VERDICTS, "reason", {r.name for r in Reason}),
            ("ray_" + metrics.DEADLINE_MISSES, "kind", set(_DEADLINES.values()))):
        series = _series(text, name)
        for replica in ready:
            mine = {s[key]: v for s, v in series if s["replica"] == replica}
            assert mine == dict.fromkeys(values, 0.0), (name, replica, mine)
    phases = {(s["replica"], s["rank"], s["slot"], s["phase"])
              for s, _ in _series(text, "ray_" + metrics.PHASE_SAMPLES)}
    for replica in ready:
        slots = {(slot, phase) for r, rank, slot, phase in phases if r == replica}
        assert (metrics.FORWARD_SLOT, metrics.PHASE_FORWARD) in slots, (replica, phases)
        assert {p for s, p in slots} == {metrics.PHASE_ROWS, metrics.PHASE_FORWARD}
    steps = {s["tokens"] for s, v in _series(text, "ray_" + metrics.HANDOFF + "_count") if v}
    assert steps and steps <= {metrics.tokens_bucket(t) for t in (1, 4, 16, 64, 256)}, steps


def _replica_trees(server_cls: str) -> list[int]:
    """The replicas of one server class and every process under them (engine core, workers)."""
    pids = []
    for p in psutil.process_iter(["cmdline"]):
        if f"ServeReplica:ple:{server_cls}:" in " ".join(p.info["cmdline"] or []):
            pids += [p.pid] + [c.pid for c in p.children(recursive=True)]
    return pids


def test_nothing_left_after_stop(served):
    shm_files = files_of(_replica_trees("PleLLMServer"))  # ZMQ's socket files among them
    assert any(f.startswith(SHM_DIR + "psm_") for f in shm_files), shm_files
    # The unoffloaded reference is Ray Serve LLM's own `LLMServer`: vLLM leaves its message
    # queues behind when Ray stops it. Not ray-ple's to fix; the test tidies them up itself.
    reference_files = files_of(_replica_trees("LLMServer"))
    served.stop()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (ple_processes() or ple_shm_entries()):
        time.sleep(1)
    assert ple_processes() == [] and ple_shm_entries() == []
    try:
        left = sorted(f for f in shm_files if os.path.exists(f))
        assert left == [], f"vLLM's /dev/shm names or socket files left: {left}"
    finally:
        remove_unused(reference_files)
