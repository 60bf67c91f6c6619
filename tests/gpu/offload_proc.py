"""The offload side of the GPU rig: a separate CPU-only process, no torch, no CUDA.

Runs `OffloadActor(spec).setup()` exactly as the Ray actor would (the actor class runs without
Ray too) and speaks one JSON line per command on stdin/stdout:

    (start)   -> {"handle": {...}, "pid": ...}
    status    -> the actor's PairStatus plus evidence that no CUDA context exists here
    close     -> closes the actor and exits

This file must never import torch: the proof that the writer holds no CUDA context is read
from this very process.
"""

from __future__ import annotations

import json
import os
import sys

from ray_ple.offload.actor import OffloadActor


def cuda_libraries_mapped(pid: int | str = "self") -> list[str]:
    """CUDA driver/runtime libraries in this process's address space (none expected)."""
    found = set()
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            path = line.rsplit(" ", 1)[-1].strip()
            name = os.path.basename(path)
            if name.startswith(("libcuda.", "libcudart.", "libnvidia-", "libnvrtc.")):
                found.add(path)
    return sorted(found)


def _plain(obj: object) -> dict:
    """A frozen model (what the actor returns across a Ray call) as JSON-ready data."""
    return obj.model_dump(mode="json") if hasattr(obj, "model_dump") else dict(obj)


def main() -> None:
    spec = json.loads(sys.stdin.readline())
    actor = OffloadActor(spec)
    handle = actor.setup()
    print(json.dumps({"handle": _plain(handle), "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "status":
            status = _plain(actor.status())
            status["cuda_libraries_mapped"] = cuda_libraries_mapped()
            status["cuda_visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES")
            print(json.dumps(status), flush=True)
        elif cmd == "close":
            actor.close()
            print(json.dumps({"closed": True}), flush=True)
            return


if __name__ == "__main__":
    main()
