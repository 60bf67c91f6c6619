"""`ray-ple doctor` where a GPU exists: the cuda check, and memlock decided by a real
registration (what the GPU pods' init container runs). Skipped without an NVIDIA device."""

from __future__ import annotations

import glob
import resource
import subprocess
import sys

import pytest

needs_gpu = pytest.mark.skipif(not glob.glob("/dev/nvidia[0-9]*"),
                               reason="needs an NVIDIA GPU (/dev/nvidia*)")
PAIR_E4B = 176201728  # one Gemma 4 E4B worker's pair segment (k8s/rayservice-gemma4-e4b-gpu)


def doctor(*args: str, memlock: int | None = None) -> tuple[int, dict[str, str], str]:
    def limit() -> None:
        if memlock is not None:
            resource.setrlimit(resource.RLIMIT_MEMLOCK, (memlock, memlock))

    proc = subprocess.run([sys.executable, "-m", "ray_ple.tools.cli", "doctor", *args], check=False,
                          capture_output=True, text=True, timeout=120, preexec_fn=limit)
    print(proc.stdout)
    lines = proc.stdout.splitlines()
    return proc.returncode, {ln.split()[1].rstrip(":"): ln.split()[0] for ln in lines}, \
        proc.stdout


@needs_gpu
def test_gpu_pod_checks_pass_under_a_64_kib_memlock():
    """The GPU pods need no memlock setting: registration succeeds under 64 KiB."""
    rc, got, out = doctor("--transport", "cuda", "--pair-bytes", str(PAIR_E4B),
                          "--table-bytes", "1Gi", memlock=64 * 1024)
    assert got["cuda"] == "PASS", out
    assert got["memlock"] == "PASS" and "succeeded" in out, out
    assert rc == 0, out


@needs_gpu
def test_cpu_transport_on_a_gpu_node_warns_and_loads_no_cuda():
    code = ("import sys; from ray_ple.tools.cli import main; rc = main(['doctor', '--transport', "
            "'cpu', '--table-bytes', '1Mi']); print('LOADED', sorted(m for m in sys.modules "
            "if m.split('.')[0] == 'cuda')); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                          text=True, timeout=60)
    assert "WARN cuda: a GPU is visible but the transport is cpu" in proc.stdout, proc.stdout
    assert "LOADED []" in proc.stdout and proc.returncode == 0, proc.stdout + proc.stderr
