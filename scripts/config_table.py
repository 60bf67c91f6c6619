"""The `ple:` block's tables in docs/configuration.md, generated from `PleConfig`.

A key whose description starts with "advanced" goes to the second table (tests and benchmarks
set those; a served model needs none). `python scripts/config_table.py --write` rewrites the
tables between their markers; `tests/test_docs.py` fails while they differ from this output.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "configuration.md"
BEGIN, END = "<!-- ple-table:{} begin (scripts/config_table.py) -->", "<!-- ple-table:{} end -->"


def _default(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def rows(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, str, str]]:
    """(key, default, description) of every leaf key, nested blocks as dotted keys."""
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            yield from rows(kind, f"{key}.")
            continue
        default = field.default if field.default is not PydanticUndefined else None
        yield key, _default(default), " ".join((field.description or "").split())


def tables() -> dict[str, str]:
    """The markdown of both tables, by name (`main`, `advanced`)."""
    from ray_ple.config import PleConfig

    out: dict[str, list[str]] = {"main": [], "advanced": []}
    for key, default, text in rows(PleConfig):
        advanced = text.lower().startswith("advanced")
        if advanced:
            text = text.split(":", 1)[1].strip() if text.lower().startswith("advanced:") else text
        cell = text.replace("|", "\\|")
        out["advanced" if advanced else "main"].append(f"| `{key}` | `{default}` | {cell} |")
    head = "| key | default | meaning |\n|---|---|---|\n"
    return {name: head + "\n".join(lines) for name, lines in out.items()}


def render(doc: str) -> str:
    """`doc` with each table between its markers replaced by the generated one."""
    for name, table in tables().items():
        begin, end = BEGIN.format(name), END.format(name)
        if begin not in doc or end not in doc:
            raise ValueError(f"{DOC.name} has no {begin} ... {end} block")
        head, rest = doc.split(begin, 1)
        doc = f"{head}{begin}\n{table}\n{end}{rest.split(end, 1)[1]}"
    return doc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite {DOC.relative_to(ROOT)}")
    args = parser.parse_args()
    current = DOC.read_text()
    wanted = render(current)
    if args.write:
        DOC.write_text(wanted)
        return 0
    print("\n\n".join(tables().values()))
    return 0 if wanted == current else 1


if __name__ == "__main__":
    sys.exit(main())
