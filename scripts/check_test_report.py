"""A test run counts only if every test it selected ran to the end and skipped only as expected.

pytest's own exit status misses two ways a run can lie: a process that ends itself mid-run with
status 0 (`os._exit(0)` from a stray timer) leaves the remaining tests unrun and unreported, and a
skip (a missing tool, a fixture that gave up) is green. This file holds both halves of the check,
so the record's format is written once:

- the pytest plugin: `python -m pytest -p scripts.check_test_report --test-record FILE ...`
  writes, one flushed JSON line at a time, the tests the run selected (after `-k`/`-m`
  deselection, so a narrowed run is not taken for a lost one), each phase's outcome, and the
  session's end. Lines written before the process died stay in the file.
- the check: `python scripts/check_test_report.py FILE --pytest-exit N [--pytest-output LOG]`
  reads that record after pytest has ended, however it ended, and fails (listing them) on a
  selected test that never finished, a skip not in `CPU_MACHINE_SKIPS`, a collection error, a
  session that never reached its end, or a nonzero pytest status (which it keeps as its own).
  It prints the expected skips it allowed, and pytest's closing line from LOG last.

`scripts/test.sh` runs both.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import re
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO, Annotated, Literal

import pytest
from pydantic import BaseModel, Field, TypeAdapter, ValidationError


class ExpectedSkip(BaseModel):
    """A skip that is right on a CPU machine: node ids and skip reason as fnmatch patterns."""

    nodeid: str
    reason: str
    why: str

    def allows(self, nodeid: str, reason: str) -> bool:
        return fnmatch.fnmatchcase(nodeid, self.nodeid) and fnmatch.fnmatchcase(reason,
                                                                                 self.reason)


# The only skips a run on a CPU machine (CI, a developer's) may have. Every other `skipif` of the
# suite holds on that machine (root, two cores, a settable hugetlb pool), so its skip there means
# the test did not run where it should have.
CPU_MACHINE_SKIPS: tuple[ExpectedSkip, ...] = (
    ExpectedSkip(nodeid="tests/gpu/*", reason="*needs a*GPU*",
                 why="GPU tests: no GPU here; scripts/gpu_device_run.sh runs them on one"),
)


# --- the record: one JSON object per line ---------------------------------------------------

class Selected(BaseModel):
    """The tests the run will execute, in order, after deselection."""

    kind: Literal["selected"] = "selected"
    nodeids: list[str]


class Collect(BaseModel):
    """A collector that failed (import error) or skipped (module-level skip): its tests are
    not in `Selected`, so the check sees them here."""

    kind: Literal["collect"] = "collect"
    nodeid: str
    outcome: Literal["failed", "skipped"]
    reason: str


class Phase(BaseModel):
    """One of a test's setup, call and teardown; a test finished once its teardown is here."""

    kind: Literal["phase"] = "phase"
    nodeid: str
    when: Literal["setup", "call", "teardown"]
    outcome: Literal["passed", "failed", "skipped"]
    reason: str = ""
    xfail: bool = False


class Finish(BaseModel):
    """pytest reached the end of its session."""

    kind: Literal["finish"] = "finish"
    exitstatus: int


Line = Annotated[Selected | Collect | Phase | Finish, Field(discriminator="kind")]
LINE = TypeAdapter(Line)


def _skip_reason(longrepr: object) -> str:
    """The message of a skip (`(path, lineno, "Skipped: why")` for a skip), else its text."""
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr or "")


def _last_line(longrepr: object) -> str:
    """The last line of an error's text: the exception (`E   ImportError: ...`)."""
    rows = [row.strip() for row in str(longrepr or "").splitlines() if row.strip()]
    return rows[-1] if rows else ""


class Recorder:
    """The plugin's writer: registered by `pytest_configure` only when `--test-record` is set."""

    def __init__(self, path: Path) -> None:
        self._file: IO[str] = path.open("w", encoding="utf-8")

    def _write(self, line: BaseModel) -> None:
        self._file.write(line.model_dump_json() + "\n")
        self._file.flush()

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.outcome in ("failed", "skipped"):
            self._write(Collect(nodeid=report.nodeid, outcome=report.outcome,
                                reason=_skip_reason(report.longrepr) if report.skipped
                                else _last_line(report.longrepr)))

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self._write(Selected(nodeids=[item.nodeid for item in session.items]))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._write(Phase(nodeid=report.nodeid, when=report.when, outcome=report.outcome,
                          reason=_skip_reason(report.longrepr) if report.skipped else "",
                          xfail=hasattr(report, "wasxfail")))

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        self._write(Finish(exitstatus=int(exitstatus)))
        self._file.close()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--test-record", metavar="FILE", default=None,
                     help="write the selected tests and each outcome to FILE, line by line "
                          "(read by scripts/check_test_report.py)")


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("test_record")
    if path:
        config.pluginmanager.register(Recorder(Path(path)), "check-test-report-recorder")


# --- the check -------------------------------------------------------------------------------

class Verdict(BaseModel):
    """What a record says about its run; `problems` empty means every selected test finished
    and every skip was expected."""

    selected: int
    counts: dict[str, int]  # passed / failed / skipped / xfailed / xpassed of finished tests
    allowed_skips: list[tuple[str, str]]  # (nodeid, why)
    lost: list[str]  # "nodeid (started, never finished)" / "nodeid (never started)"
    unexpected_skips: list[str]  # "nodeid: reason"
    collect_problems: list[str]
    finished: bool
    notes: list[str]  # a record that could not be read whole

    @property
    def problems(self) -> list[str]:
        out = []
        if self.lost:
            out.append(f"{len(self.lost)} lost")
        if self.unexpected_skips:
            out.append(f"{len(self.unexpected_skips)} unexpected skip"
                       f"{'s' if len(self.unexpected_skips) > 1 else ''}")
        if self.collect_problems:
            out.append(f"{len(self.collect_problems)} collection problem"
                       f"{'s' if len(self.collect_problems) > 1 else ''}")
        if not self.finished:
            out.append("no session end")
        out.extend(self.notes)
        return out


def read_record(text: str) -> tuple[list[Selected | Collect | Phase | Finish], list[str]]:
    """The record's lines, and notes on any that could not be read. A last line cut short
    (the process killed mid-write) is dropped with a note; a bad line elsewhere is a note too,
    so the check fails rather than guess."""
    lines: list[Selected | Collect | Phase | Finish] = []
    notes: list[str] = []
    raw = text.splitlines()
    for i, row in enumerate(raw):
        try:
            lines.append(LINE.validate_python(json.loads(row)))
        except (ValueError, ValidationError):
            where = "last line cut short" if i == len(raw) - 1 else f"line {i + 1} unreadable"
            notes.append(f"record {where}")
    return lines, notes


def check(lines: Iterable[Selected | Collect | Phase | Finish],
          expected: Sequence[ExpectedSkip] = CPU_MACHINE_SKIPS,
          notes: Sequence[str] = ()) -> Verdict:
    selected: list[str] | None = None
    phases: dict[str, list[Phase]] = {}
    collect_problems: list[str] = []
    skips: list[tuple[str, str]] = []  # collectors skipped whole: their tests never appear
    finished = False
    for line in lines:
        if isinstance(line, Selected):
            selected = line.nodeids
        elif isinstance(line, Collect):
            if line.outcome == "skipped":
                skips.append((line.nodeid, line.reason))
            else:
                collect_problems.append(f"{line.nodeid}: collection error: {line.reason}")
        elif isinstance(line, Phase):
            phases.setdefault(line.nodeid, []).append(line)
        else:
            finished = True
    if selected is None:
        collect_problems.append("the run recorded no selection (it ended during collection)")
        selected = []
    counts: dict[str, int] = {}
    lost: list[str] = []
    for nodeid in selected:
        seen = phases.get(nodeid, [])
        if not any(p.when == "teardown" for p in seen):
            lost.append(f"{nodeid} ({'started, never finished' if seen else 'never started'})")
            continue
        outcome = _outcome(seen)
        counts[outcome] = counts.get(outcome, 0) + 1
        if outcome == "skipped":
            skips.append((nodeid, next(p.reason for p in seen if p.outcome == "skipped")))
    allowed: list[tuple[str, str]] = []
    unexpected: list[str] = []
    for nodeid, reason in skips:
        rule = next((e for e in expected if e.allows(nodeid, reason)), None)
        if rule is None:
            unexpected.append(f"{nodeid}: {reason}")
        else:
            allowed.append((nodeid, rule.why))
    return Verdict(selected=len(selected), counts=counts, allowed_skips=allowed, lost=lost,
                   unexpected_skips=unexpected, collect_problems=collect_problems,
                   finished=finished, notes=list(notes))


def _outcome(phases: list[Phase]) -> str:
    """pytest's word for a finished test: failed (any phase, an error in setup or teardown
    included), skipped, xfailed, xpassed or passed."""
    if any(p.outcome == "failed" for p in phases):
        return "failed"
    if any(p.xfail for p in phases):
        return "xfailed" if any(p.outcome == "skipped" for p in phases) else "xpassed"
    if any(p.outcome == "skipped" for p in phases):
        return "skipped"
    return "passed"


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_CLOSING = re.compile(r"^=*\s*([0-9]+ [a-z]+|no tests ran).* in [0-9.]+s( \([0-9:]+\))?\s*=*$")


def closing_line(output: str) -> str | None:
    """pytest's last summary line ("=== 3 passed, 1 skipped in 2.01s ===", undecorated with
    `-q`) as it was printed."""
    for row in reversed(output.splitlines()):
        if _CLOSING.match(_ANSI.sub("", row).strip()):
            return row
    return None


def report(verdict: Verdict, pytest_exit: int) -> list[str]:
    """The check's lines, in print order."""
    counts = ", ".join(f"{n} {k}" for k, n in sorted(verdict.counts.items()))
    out = [f"test record: {verdict.selected} selected, "
           f"{sum(verdict.counts.values())} finished ({counts or 'none'}); "
           f"pytest exit status {pytest_exit}"]
    if verdict.allowed_skips:
        out.append(f"expected skips on a CPU machine, allowed ({len(verdict.allowed_skips)}):")
        out.extend(f"  {nodeid}  [{why}]" for nodeid, why in verdict.allowed_skips)
    for title, items in (("LOST: selected but never finished", verdict.lost),
                         ("UNEXPECTED SKIPS (not in CPU_MACHINE_SKIPS)",
                          verdict.unexpected_skips),
                         ("COLLECTION", verdict.collect_problems)):
        if items:
            out.append(f"{title} ({len(items)}):")
            out.extend(f"  {item}" for item in items)
    if not verdict.finished:
        out.append("pytest never reached the end of its session (the process ended early)")
    problems = verdict.problems + ([f"pytest exit status {pytest_exit}"] if pytest_exit else [])
    out.append(f"test record check: {'FAIL (' + '; '.join(problems) + ')' if problems else 'OK'}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Print the check; the exit status is pytest's where that is nonzero, else 1 on a
    problem, else 0."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("record", type=Path, help="the file --test-record wrote")
    ap.add_argument("--pytest-exit", type=int, required=True, help="pytest's exit status")
    ap.add_argument("--pytest-output", type=Path,
                    help="pytest's stdout: its closing line is printed again, last")
    args = ap.parse_args(argv)
    try:
        lines, notes = read_record(args.record.read_text(encoding="utf-8"))
    except FileNotFoundError:
        lines, notes = [], [f"no record at {args.record} (pytest never started the plugin)"]
    verdict = check(lines, notes=notes)
    text = (args.pytest_output.read_text(encoding="utf-8", errors="replace")
            if args.pytest_output is not None else None)
    if text and not text.endswith("\n"):
        print()  # pytest died mid-line (its progress dots): start on a line of our own
    for row in report(verdict, args.pytest_exit):
        print(row)
    if text is not None:
        print(closing_line(text) or "(pytest printed no closing line: it ended before its "
                                    "summary)")
    sys.stdout.flush()
    if args.pytest_exit:
        return args.pytest_exit
    return 1 if verdict.problems else 0


if __name__ == "__main__":
    sys.exit(main())
