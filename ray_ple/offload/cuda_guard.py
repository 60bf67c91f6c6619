"""Keep CUDA out of a process (the offload actor), and say whether it got in anyway.

The offload actor gathers rows with numpy (or CPU torch) only. It hides every GPU before
anything could initialise CUDA, and `cuda_evidence` reports what would betray a context:
open `/dev/nvidia*` files or an initialised torch CUDA runtime.
"""

from __future__ import annotations

import os
import sys

from ray_ple.errors import PleEnvironmentError


def hide_cuda() -> None:
    """Make a CUDA context impossible in this process: no device is visible to it."""
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized():
        raise PleEnvironmentError("CUDA was initialised in this process before ray-ple could "
                                  "hide the GPUs: an offload actor must never hold a context")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ["NVIDIA_VISIBLE_DEVICES"] = "void"


def cuda_evidence(pid: int | str = "self") -> list[str]:
    """Files of `/dev/nvidia*` open in `pid`, and whether torch initialised CUDA here."""
    found = []
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(os.path.join(fd_dir, fd))
        except OSError:
            continue
        if target.startswith("/dev/nvidia"):
            found.append(target)
    if pid == "self" and "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized():
        found.append("torch.cuda initialised")
    return found
