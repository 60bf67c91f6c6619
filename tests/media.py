"""The environment of an engine that serves images and audio on a CPU machine."""

from __future__ import annotations

import os

from tests.engines import REPO

# where scripts/install.sh puts torchvision's Python half, apart from the environment
TORCHVISION = os.path.join(REPO, ".venv", "media-torchvision")


def media_env() -> dict[str, str]:
    """`PYTHONPATH` for a process (and the engine processes it spawns) that imports Gemma 4's
    processor: tests/media_env first, then torchvision; a missing install is an error."""
    if not os.path.isdir(os.path.join(TORCHVISION, "torchvision")):
        raise RuntimeError(f"{TORCHVISION} holds no torchvision: run scripts/install.sh")
    paths = [os.path.join(REPO, "tests", "media_env"), TORCHVISION,
             os.environ.get("PYTHONPATH", "")]
    return {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}
