"""The environment of an engine that serves images and audio on a CPU machine."""

from __future__ import annotations

import os

from tests.engines import REPO

# where scripts/install.sh puts torchvision's Python half and timm, apart from the environment
ASIDE = os.path.join(REPO, ".venv", "media-aside")


def media_env() -> dict[str, str]:
    """`PYTHONPATH` for a process (and the engine processes it spawns) that imports Gemma 4's
    processor or Gemma 3n's vision tower: tests/media_env first, then torchvision and timm;
    a missing install is an error."""
    for name in ("torchvision", "timm"):
        if not os.path.isdir(os.path.join(ASIDE, name)):
            raise RuntimeError(f"{ASIDE} holds no {name}: run scripts/install.sh")
    paths = [os.path.join(REPO, "tests", "media_env"), ASIDE,
             os.environ.get("PYTHONPATH", "")]
    return {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}
