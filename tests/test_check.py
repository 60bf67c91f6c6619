"""`ray-ple check SERVE.yaml`: `build_app`'s validation and the node's room, without Ray.

A bad config's stderr is exactly the error `build_app` raises for it (`serve run`'s text);
a shipped config passes wherever its checkpoint is here, and names the missing one otherwise.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from ray_ple.checkpoints.source import SCHEME
from ray_ple.errors import PleError
from ray_ple.serve.builder import build_app
from ray_ple.tools.check import main as check
from tests.media import media_env
from tests.serving import REPO, load_config

CONFIGS = sorted(p.name for p in (REPO / "serve_configs").glob("*.yaml"))


def _sources(name: str) -> list[str]:
    return [llm["model_loading_config"].get("model_source", "")
            for app in load_config(name)["applications"] for llm in app["args"]["llm_configs"]]


def _asks_media(name: str) -> bool:
    return any(llm["engine_kwargs"].get("limit_mm_per_prompt")
               for app in load_config(name)["applications"] for llm in app["args"]["llm_configs"])


def _here(source: str) -> bool:
    return source.startswith(SCHEME) or (Path(source) / "config.json").is_file()


def _write(tmp_path: Path, cfg: dict) -> str:
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _bad(change) -> dict:
    cfg = load_config()
    change(cfg["applications"][0]["args"]["llm_configs"][0])
    return cfg


BAD = {
    "unknown-ple-key": lambda llm: llm["ple"].update(gather_thread=4),
    "transport-gpu": lambda llm: llm["ple"].update(transport="gpu"),
    "speculative-eagle": lambda llm: llm["engine_kwargs"].update(
        speculative_config={"method": "eagle", "model": "some-eagle-head",
                            "num_speculative_tokens": 2}),
    "negative-step-deadline": lambda llm: llm["ple"].update(deadlines={"step_s": -1}),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_every_shipped_config_passes_where_its_checkpoint_is(name, capsys):
    """Exit 0 with one line per model (table, shape, dtype, bytes, slots) and the node's
    checks; a checkpoint that is not on this machine is exit 1 naming it, and
    `--no-checkpoint` still validates the rest."""
    path = str(REPO / "serve_configs" / name)
    sources = _sources(name)
    if _asks_media(name):  # Gemma 4's processor imports torchvision: as tests/media.py has it
        proc = subprocess.run([sys.executable, "-m", "ray_ple.tools.cli", "check", path],
                              cwd=REPO, capture_output=True, text=True, timeout=300,
                              env={**os.environ, **media_env()})
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    else:
        rc = check(path)
        out, err = capsys.readouterr()
    if all(_here(s) for s in sources):
        assert rc == 0, out + err
        lines = out.splitlines()
        ids = [llm["model_loading_config"]["model_id"] for app in load_config(name)[
            "applications"] for llm in app["args"]["llm_configs"]]
        assert [line.split(":")[0] for line in lines if " pair segment " in line] == ids, out
        assert all(re.search(r": table \S+ \[\d+, \d+\] \w+ \d+ B", line)
                   for line in lines if " pair segment " in line), out
        assert "PASS shm: " in out and "PASS host-memory: " in out and lines[-1] == f"ok {path}"
    else:
        missing = next(s for s in sources if not _here(s))
        assert rc == 1 and err == f"no config.json in {missing}: ray-ple needs a local " \
                                  "checkpoint\n", err
        assert check(path, read_checkpoint=False) == 0, capsys.readouterr()


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_config_is_build_apps_own_error(case, tmp_path, capsys):
    """stderr is the error `build_app` raises for the same args (it raises before it needs
    Ray), one line; nothing on stdout."""
    cfg = _bad(BAD[case])
    with pytest.raises(PleError) as raised:
        build_app(cfg["applications"][0]["args"])
    assert check(_write(tmp_path, cfg)) == 1
    out, err = capsys.readouterr()
    assert out == "" and err == f"{raised.value}\n" and "\n" not in str(raised.value)


def test_check_runs_alone_without_ray_and_exits_1_on_a_bad_config(tmp_path):
    """As typed: a fresh process, no Ray runtime started, no traceback; the wall time is
    Ray Serve LLM's import, then milliseconds."""
    code = ("import sys, ray; from ray_ple.tools.cli import main; rc = main(sys.argv[1:]); "
            "print('RAY', ray.is_initialized()); sys.exit(rc)")
    bad = _write(tmp_path, _bad(BAD["transport-gpu"]))
    t0 = time.monotonic()
    good = subprocess.run([sys.executable, "-c", code, "check", "serve_configs/ple.yaml"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    wall = time.monotonic() - t0
    assert good.returncode == 0, good.stdout + good.stderr
    assert good.stdout.splitlines()[-1] == "RAY False"
    proc = subprocess.run([sys.executable, "-m", "ray_ple.tools.cli", "check", bad], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr == ("invalid configuration: llm_configs[0].ple.transport: Input should "
                           "be 'auto', 'cpu' or 'cuda' (got 'gpu')\n"), proc.stderr
    print(json.dumps({"check_wall_s": round(wall, 2)}))


def test_a_node_without_room_fails(tmp_path, capsys):
    """The table and pair segments are set against the real free space of the shm dir."""
    shm = tmp_path / "tiny-shm"
    shm.mkdir()
    rc = check(str(REPO / "serve_configs" / "ple.yaml"), shm_dir="/nonexistent-ray-ple-shm")
    out, _ = capsys.readouterr()
    assert rc == 1 and "FAIL shm: /nonexistent-ray-ple-shm" in out


def test_check_sets_the_segments_against_each_models_shm_dir(tmp_path, capsys):
    """`ple.shm_dir` is where the server puts a model's table and pair: `check` looks there
    unless `--shm-dir` says otherwise."""
    cfg = load_config()
    cfg["applications"][0]["args"]["llm_configs"][0]["ple"]["shm_dir"] = "/nonexistent-ple-shm"
    path = _write(tmp_path, cfg)
    assert check(path) == 1
    out, _ = capsys.readouterr()
    assert "FAIL shm: /nonexistent-ple-shm" in out, out
    assert check(path, shm_dir="/dev/shm") == 0, capsys.readouterr()
