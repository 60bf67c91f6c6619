"""A `model_source` -> the local checkpoint directory every process reads.

`ray-ple://<preset>` names an embedded model (`tiny.py`), built once into the ray-ple cache on
the node that asks; anything else is a local checkpoint directory, passed through unchanged.
"""

from __future__ import annotations

from ray_ple.errors import PleModelError

SCHEME = "ray-ple://"


def resolve(source: str) -> str:
    """`ray-ple://<preset>` -> a local checkpoint directory (built once); others unchanged."""
    if not source.startswith(SCHEME):
        return source
    from ray_ple.checkpoints.tiny import PRESETS, build

    name = source[len(SCHEME):]
    if name not in PRESETS:
        raise PleModelError(f"unknown embedded model {source!r}; one of "
                            f"{[SCHEME + n for n in PRESETS]}")
    return str(build(PRESETS[name]))
