"""Kubernetes-style quantities ("5Gi", "176Mi", "500m", "4") to numbers, and back.

Manifests, `k8s/spec/clusters.yaml` and `ray-ple doctor` flags all speak this one notation, so a
number read from a manifest can be compared with a number the arithmetic derived.
"""

from __future__ import annotations

import math
import re

from ray_ple.errors import PleConfigError

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
_SUFFIX = {"": 1, "Ki": KiB, "Mi": MiB, "Gi": GiB, "Ti": 1 << 40, "k": 10**3, "K": 10**3,
           "M": 10**6, "G": 10**9, "T": 10**12, "m": 1e-3}
_QUANTITY = re.compile(r"^\s*(?P<num>[0-9]+(?:\.[0-9]+)?)\s*(?P<suffix>[A-Za-z]*)\s*$")


def parse_quantity(value: str | float) -> float:
    """A quantity as a plain number ("1Gi" -> 1073741824, "500m" -> 0.5)."""
    if isinstance(value, (int, float)):
        return float(value)
    m = _QUANTITY.match(value)
    if m is None or m["suffix"] not in _SUFFIX:
        raise PleConfigError(f"not a quantity: {value!r} (e.g. 4, 500m, 176Mi, 5Gi)")
    return float(m["num"]) * _SUFFIX[m["suffix"]]


def parse_bytes(value: str | int) -> int:
    return math.ceil(parse_quantity(value))


def gib_up(nbytes: int) -> str:
    """Whole GiB, rounded up: what a memory request is written in."""
    return f"{math.ceil(nbytes / GiB)}Gi"


def mib_up(nbytes: int) -> str:
    """Whole MiB, rounded up: a /dev/shm size close to what it holds."""
    return f"{math.ceil(nbytes / MiB)}Mi"


def human(nbytes: float) -> str:
    """Short, for doctor lines and comments (binary units)."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{int(nbytes)} B"
