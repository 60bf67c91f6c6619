"""Helpers for tests that run the real `serve run` command and talk to its OpenAI API."""

from __future__ import annotations

import base64
import contextlib
import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import requests
import yaml

REPO = Path(__file__).resolve().parent.parent
BASE = "http://127.0.0.1:8000"


def load_config(name: str = "ple.yaml") -> dict[str, Any]:
    return yaml.safe_load((REPO / "serve_configs" / name).read_text())


def _ctrl_c_works() -> None:
    """A shell that starts pytest in the background without job control makes it ignore
    SIGINT, and `serve run` would inherit that: `stop()`'s Ctrl-C would do nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# Ray's `serve` console script, run by the interpreter: where Ray is on PYTHONPATH without
# its console scripts (the GPU machine's unpacked bundle), there is no `serve` binary.
SERVE_CLI = ("import sys; from ray.serve.scripts import cli; sys.argv[0] = 'serve'; "
             "sys.exit(cli())")


def serve_command() -> list[str]:
    """The `serve` command: the console script beside the interpreter, as a user types it;
    only where there is none, the same CLI through the interpreter."""
    serve_bin = Path(sys.executable).with_name("serve")
    if serve_bin.exists():
        return [str(serve_bin)]
    return [sys.executable, "-c", SERVE_CLI]


def child_env(changes: dict[str, str | None]) -> dict[str, str]:
    """This process's environment with `changes` (None: the variable removed, as a user who
    never set it has it)."""
    env = {**os.environ, **{k: v for k, v in changes.items() if v is not None}}
    for k in [k for k, v in changes.items() if v is None]:
        env.pop(k, None)
    return env


class ServeRun:
    """`serve run <config>` as a user types it, in its own process group and Ray cluster."""

    def __init__(self, config: Path, log: Path,
                 env: dict[str, str | None] | None = None) -> None:
        self.log = log
        self._out = open(log, "w")
        self.proc = subprocess.Popen(
            [*serve_command(), "run", str(config)], cwd=REPO, stdout=self._out,
            stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_ctrl_c_works,
            env=child_env({"RAY_ADDRESS": "local", **(env or {})}))

    def wait_ready(self, model: str, timeout: float = 420) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve run exited: {self.log.read_text()[-4000:]}")
            try:
                r = requests.post(f"{BASE}/v1/completions", timeout=10, json={
                    "model": model, "prompt": "w5", "max_tokens": 1})
                if r.status_code == 200:
                    return time.monotonic() - t0
            except requests.RequestException:
                pass
            time.sleep(2)
        raise TimeoutError(f"{model} not served in {timeout}s: {self.log.read_text()[-4000:]}")

    def stop(self, timeout: float = 60) -> None:
        """Ctrl-C, as a user would; then whatever of this run's own Ray cluster is left (its
        processes descend from `serve run`), never another cluster on the machine."""
        try:
            tree = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            tree = []
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        left = [p for p in tree if p.is_running()]
        for p in left:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(left, timeout=10)
        self._out.close()


def complete(model: str, prompt: list[int] | str, max_tokens: int = 8, **extra: Any) -> dict:
    r = requests.post(f"{BASE}/v1/completions", timeout=60, json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True, **extra})
    r.raise_for_status()
    return r.json()


def offload_pids() -> list[int]:
    return [p.pid for p in psutil.process_iter(["cmdline"])
            if "OffloadActor" in " ".join(p.info["cmdline"] or [])]


def table_mappings(pid: int) -> set[tuple[str, str]]:
    """(inode, path) of the node-table segments a process maps."""
    out = set()
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and "ray-ple-table" in parts[5]:
                out.add((parts[4], parts[5].strip()))
    return out


def image_part(rgb: tuple[int, int, int], size: int = 8) -> dict:
    """An OpenAI chat content part: a one-colour PNG as a data URL."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (size, size), rgb).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def video_part(rgb: tuple[int, int, int], frames: int = 2, size: int = 96) -> dict:
    """An OpenAI chat content part: an MP4 of `frames` one-colour frames at 2 fps, as a data
    URL (vLLM's video loader reads at most the frames it holds)."""
    import tempfile

    import cv2
    import numpy as np

    with tempfile.TemporaryDirectory() as d:
        path = f"{d}/v.mp4"
        out = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), 2.0, (size, size))
        for _ in range(frames):
            out.write(np.full((size, size, 3), rgb[::-1], dtype=np.uint8))  # BGR
        out.release()
        with open(path, "rb") as f:
            data = base64.b64encode(f.read()).decode()
    return {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + data}}


def audio_part(hz: float | None, seconds: float = 0.1) -> dict:
    """An OpenAI chat content part: 16 kHz mono WAV, a tone of `hz` (None: silence)."""
    import wave

    import numpy as np

    t = np.arange(int(16000 * seconds)) / 16000
    wave_ = np.zeros_like(t) if hz is None else 0.5 * np.sin(2 * np.pi * hz * t)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000)
        w.writeframes((wave_ * 32767).astype("<i2").tobytes())
    return {"type": "input_audio",
            "input_audio": {"data": base64.b64encode(buf.getvalue()).decode(), "format": "wav"}}
