"""What a ray-ple run could leave behind: named segments and processes."""

from __future__ import annotations

import os

import psutil


def ple_shm_entries(shm_dir: str = "/dev/shm") -> list[str]:
    return sorted(n for n in os.listdir(shm_dir) if "ray-ple" in n)


def ple_processes() -> list[str]:
    """Processes of ray-ple's own: offload actors, serve replicas, vLLM engines of ours."""
    me = os.getpid()
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if p.info["pid"] == me:
            continue
        cmd = " ".join(p.info["cmdline"] or [])
        if any(k in cmd for k in ("OffloadActor", "PleLLMServer", "ray-ple-offload",
                                  "offload_proc.py")):
            found.append(f"{p.info['pid']}: {cmd[:120]}")
    return found

