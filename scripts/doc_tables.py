"""The docs' generated tables: the `ple:` block's (docs/configuration.md) from `PleConfig`, and
what is served (docs/models.md) from `protocol/support.py`.

A `ple:` key whose description starts with "advanced" goes to the second table (tests and
benchmarks set those; a served model needs none). `python scripts/doc_tables.py --write`
rewrites each table between its markers; `tests/test_docs.py` fails while one differs.
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
DOCS = {"main": ROOT / "docs" / "configuration.md", "advanced": ROOT / "docs" / "configuration.md",
        "support": ROOT / "docs" / "models.md"}
BEGIN, END = "<!-- table:{} begin (scripts/doc_tables.py) -->", "<!-- table:{} end -->"


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
    """The markdown of every table, by name (the keys of `DOCS`)."""
    from ray_ple.config import PleConfig
    from ray_ple.protocol.support import served_rows

    out: dict[str, list[str]] = {"main": [], "advanced": []}
    for key, default, text in rows(PleConfig):
        advanced = text.lower().startswith("advanced")
        if advanced:
            text = text.split(":", 1)[1].strip() if text.lower().startswith("advanced:") else text
        cell = text.replace("|", "\\|")
        out["advanced" if advanced else "main"].append(f"| `{key}` | `{default}` | {cell} |")
    head = "| key | default | meaning |\n|---|---|---|\n"
    done = {name: head + "\n".join(lines) for name, lines in out.items()}
    support = ["| checkpoint `architectures` | served on vLLM-CPU (`cpu`) | served on GPUs "
               "(`cuda`) | speculation |", "|---|---|---|---|"]
    support += [f"| `{arch}` | {cpu} | {cuda} | {spec} |"
                for arch, cpu, cuda, spec in served_rows()]
    return {**done, "support": "\n".join(support)}


def render(doc: Path, text: str) -> str:
    """`text` (of `doc`) with each of its tables between their markers generated anew."""
    for name, table in tables().items():
        if DOCS[name] != doc:
            continue
        begin, end = BEGIN.format(name), END.format(name)
        if begin not in text or end not in text:
            raise ValueError(f"{doc.name} has no {begin} ... {end} block")
        head, rest = text.split(begin, 1)
        text = f"{head}{begin}\n{table}\n{end}{rest.split(end, 1)[1]}"
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the docs' tables")
    args = parser.parse_args()
    stale = []
    for doc in sorted(set(DOCS.values())):
        current = doc.read_text()
        wanted = render(doc, current)
        if args.write:
            doc.write_text(wanted)
        elif wanted != current:
            stale.append(doc.relative_to(ROOT))
    if stale:
        print(f"stale: {', '.join(map(str, stale))} (run with --write)")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
