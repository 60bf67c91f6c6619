#!/usr/bin/env python3
"""Mutation pass over the checks that guard correctness: is each one shown to matter?

A check is an `if`/`while` condition that guards a fail path (a raise, a `Failure(...)`, a
side's `.fail(...)`/`abandon(...)`/`fail_closed(...)`, a refusal that skips or gives up, or a
wait loop whose exit is one), an `assert`, or a comparison inside a returned condition.
Mutants per check, generated with `ast`: the condition dropped (`False and (...)`, or
`True or (...)` where the fail path is the `else`), each clause of an `or`/`and` dropped alone
(made `False`/`True`), and each comparison's boundary or sense
flipped (`<`/`<=`, `>`/`>=`, `==`/`!=`, `is`/`is not`, `in`/`not in`).

The checkout is never touched: a commit (`--rev`, HEAD by default, through `git archive`) is
extracted to `--work` and the copy is what is imported (cwd and PYTHONPATH point at it).
Which tests can notice a mutant is measured once per pass, as mutmut does: the fast tests
that reach the target modules run unmutated under coverage, one context per test, in every
process they start (a `sitecustomize` on the copy's path starts coverage in each; a process
other than pytest's charges its lines to the test running at the time). Each mutant then
runs only the tests that ran its line, `-x`, the guards' rows first; a mutant whose line no
test runs survives without a run. Killed means a test failed (the first failing node id is
recorded); survived means all passed. One mutant at a time per copy: the tests start real
processes and share the node's cores.

    .venv/bin/python scripts/mutation_pass.py                     # the whole pass, table
    .venv/bin/python scripts/mutation_pass.py --only ID [ID ...]  # re-run some mutants
    .venv/bin/python scripts/mutation_pass.py --list              # the mutants, not run

Results go to `<work>/results.jsonl` (one line per mutant run; `--resume` skips mutants
already run there or killed in `--out`'s table, and reuses `<work>/coverage.json` while the
tree is the same) and the table to `--out` (docs/mutation.md), between the
markers it carries. Equivalent mutants are explained in `EQUIVALENT` below, keyed by the
mutant's stable key (file, function, original, mutant): line numbers move, keys do not.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGETS = ("ray_ple/protocol", "ray_ple/engine_settings.py", "ray_ple/table_source.py",
           "ray_ple/offload", "ray_ple/worker/pair.py")
# The order of the pass where it cannot all run: the modules the issue names first.
PRIORITY = ("ray_ple/protocol/transaction.py", "ray_ple/protocol/layout.py",
            "ray_ple/protocol/handles.py", "ray_ple/protocol/geometry.py",
            "ray_ple/protocol/shm.py", "ray_ple/offload/table_segment.py",
            "ray_ple/protocol/peers.py", "ray_ple/protocol/doorbell.py",
            "ray_ple/offload/table_store.py", "ray_ple/offload/table_broker.py",
            "ray_ple/offload/table_file.py", "ray_ple/offload/actor.py",
            "ray_ple/offload/gather.py", "ray_ple/offload/cuda_guard.py", "ray_ple/worker/pair.py")
FAIL_CALLS = {"fail", "fail_closed", "abandon", "mark_failed", "_fail", "Failure"}
FLIP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt,
        ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is,
        ast.In: ast.NotIn, ast.NotIn: ast.In}
MARK_START, MARK_END = "<!-- mutation-table:start -->", "<!-- mutation-table:end -->"

# Equivalent (or harmless-by-construction) mutants: stable key -> why the mutated code
# behaves as the original does. Filled from the pass's survivors; see docs/mutation.md.
EQUIVALENT: dict[str, str] = {
    "ray_ple/offload/actor.py:OffloadActor._serve: b is not None -> True or (b is not None)":
        "a type narrowing for the checker: the serving thread starts only after `setup` has "
        "set `self.block`, so the assertion never fails",
    "ray_ple/offload/actor.py:OffloadActor._serve: spin_s and wait_until(lambda "
    "last=end.last: b.posted != last, spin_s, spin_s=spin_s) -> True and wait_until(lambda "
    "last=end.last: b.posted != last, spin_s, spin_s=spin_s)":
        "the two differ only at spin_s == 0, and there by a race no test can place: the "
        "mutant's wait_until has a zero deadline, so it reads `posted` at most three times "
        "and returns before any nap (no sleep, no syscall). `announced` was just read equal "
        "to `end.last` and is stored before `posted`, so a post is seen there only if it "
        "was announced and posted in the microseconds since; the mutant serves it on the "
        "next turn, and the original's `end.sleep` finds `announced` ahead, does not wait, "
        "and serves it on that same turn. Only the original's `sleeping`, up for one fence "
        "meanwhile, differs: a worker posting then may ring once more (a queued ring: one "
        "early wake that finds nothing new)",
    "ray_ple/protocol/transaction.py:peer_state: block.ready() -> False and (block.ready())":
        "a fast path only: where `ready()` holds (reason 0, state word READY) the code after "
        "it reads `state` as READY and returns None too",
    "ray_ple/protocol/transaction.py:OffloadEnd.publish: int(flag[0]) != 0 and not "
    "wait_until( lambda f=flag: int(f[0]) == 0, self.deadlines.offload_wait_s, abort=alive) "
    "-> True and (not wait_until(lambda f=flag: int(f[0]) == 0, "
    "self.deadlines.offload_wait_s, abort=alive))":
        "a fast path only: `wait_until` tests its condition first and returns True at once "
        "when the flag is already down, so the wait is skipped either way",
    "ray_ple/protocol/layout.py:ControlBlock.snapshot: len(words) != layout.words_bytes -> "
    "False and (len(words) != layout.words_bytes)":
        "enforced by the size check just before (a file of at least `layout.size` bytes "
        "yields a whole words page); only a truncation between the two calls differs, and "
        "there the counters' own reads come back short (None) or the views refuse a short "
        "buffer: a race no test can place",
    "ray_ple/protocol/layout.py:ControlBlock.snapshot: any(len(word) != 8 for word in now) "
    "-> False and (any((len(word) != 8 for word in now)))":
        "enforced by the size check at the top: every counter lies in the words page, so on "
        "a file of at least `layout.size` bytes each read is 8 bytes; only a truncation "
        "during the read differs (a race no test can place)",
    "ray_ple/protocol/transaction.py:next_posted: posted < last -> posted <= last":
        "the two differ only at posted == last, and the one caller (OffloadEnd.next_step) "
        "returns None before calling it there: nothing new posted",
    "ray_ple/protocol/shm.py:_open_nameless: exc.errno not in (errno.EOPNOTSUPP, "
    "errno.EISDIR, errno.EINVAL) -> False and (exc.errno not in (errno.EOPNOTSUPP, "
    "errno.EISDIR, errno.EINVAL))":
        "the named fallback then opens a file in the same directory with the same mode and "
        "fails with the same errno (ENOENT, ENOTDIR, EACCES, ENOSPC...), raising the same "
        "PleShmError; SharedSegment.create checks the directory exists first",
    "ray_ple/protocol/shm.py:SharedSegment.create: avail < size -> False and (avail < size)":
        "harmless: posix_fallocate then refuses the same size with ENOSPC, raised as the "
        "same PleShmError ('too small for the ray-ple segment'); the check says it before "
        "the kernel reserves any page",
    "ray_ple/protocol/shm.py:SharedSegment.create: exc.errno in (errno.ENOSPC, "
    "errno.ENOMEM) -> False and (exc.errno in (errno.ENOSPC, errno.ENOMEM))":
        "harmless: the same PleShmError either way, only its wording differs ('too small' "
        "or 'cannot reserve'); ENOSPC from posix_fallocate cannot be placed on this node's "
        "/dev/shm without filling it for every other process",
    "ray_ple/offload/table_segment.py:TableSegment._create_huge: room < size -> False and "
    "(room < size)":
        "harmless: posix_fallocate on an empty hugetlb pool then fails with ENOSPC, raised "
        "as the same PleShmError ('the host's hugetlb pool cannot hold'); the check only "
        "avoids zeroing every free huge page in vain (and this node has no hugetlb pool to "
        "test it)",
    "ray_ple/protocol/shm.py:SharedSegment.create: exc.errno in (errno.ENOSPC, "
    "errno.ENOMEM) -> exc.errno not in (errno.ENOSPC, errno.ENOMEM)":
        "harmless: the same PleShmError either way, only its wording differs ('too small' "
        "or 'cannot reserve'); a failing posix_fallocate cannot be placed on this node's "
        "/dev/shm without filling it for every other process",
    "ray_ple/offload/table_segment.py:TableSegment.seal: time.monotonic() < deadline -> "
    "time.monotonic() <= deadline":
        "the two differ only when time.monotonic() returns exactly the deadline (a float "
        "sum): one more 50 ms retry at that instant; no test can place it",
    "ray_ple/protocol/doorbell.py:DoorbellListener.wait: left <= 0 -> left < 0":
        "the two differ only when the time left is exactly 0.0 (a float difference): then "
        "the mutant sets a 1 us receive timeout and reads once more, returning at once; no "
        "test can place it",
    "ray_ple/worker/pair.py:WorkerPair._transaction: faults.ACTIVE and "
    "faults.hit(\"worker.raise_after_post\", w.rank) -> True and "
    "faults.hit('worker.raise_after_post', w.rank)":
        "a fast path only: faults.hit returns None at once when faults.ACTIVE is false, so "
        "the condition is false either way",
    "ray_ple/offload/table_store.py:_acquire: now - refused_since >= _REFUSED_S -> now - "
    "refused_since > _REFUSED_S":
        "the two differ only when the refused time is exactly _REFUSED_S (a float "
        "difference of two monotonic readings): the name holder is looked up one 50 ms "
        "retry later; no test can place it",
    "ray_ple/worker/pair.py:WorkerPair._transaction: faults.ACTIVE and "
    "faults.hit(\"worker.raise_after_post\", w.rank) -> False and (faults.ACTIVE and "
    "faults.hit('worker.raise_after_post', w.rank))":
        "not a guard but a fault-injection hook (ray_ple.instrument.faults), inert unless a "
        "fault plan is armed; its fault (an exception after the post) is the slow fault "
        "suite's (tests/test_faults.py, real engines), which this pass does not run",
    "ray_ple/offload/table_store.py:_acquire: uid is not None or seen_long -> uid is not "
    "None or False":
        "differs only for a holder whose uid this side cannot see (name_holder gives None: "
        "another user's process under hidepid, or in another pid namespace), which then is "
        "never refused and waits out the deadline's PleModelError; as root on this node "
        "every holder is visible, so no test here can place it",
    "ray_ple/offload/table_store.py:_acquire: uid != os.getuid() and (uid is not None or "
    "seen_long) -> uid != os.getuid() and True":
        "differs only for a holder whose uid this side cannot see (name_holder gives None),"
        " refused at the first window instead of the fourth; as root on this node every "
        "holder is visible, so no test here can place it",
}


@dataclass(frozen=True)
class Mutant:
    """One change of one check: the byte span of the expression it replaces, and the text."""

    file: str
    function: str
    line: int
    start: int  # byte offsets in the file
    end: int
    original: str
    mutant: str
    kind: str  # "drop" (the check or one clause of it removed), "flip" (a comparison)

    @property
    def key(self) -> str:
        return f"{self.file}:{self.function}: {self.original} -> {self.mutant}"

    @property
    def id(self) -> str:
        return hashlib.sha1(self.key.encode()).hexdigest()[:10]


# Finding checks --------------------------------------------------------------------------
def _walk_no_defs(nodes: list[ast.stmt]):  # noqa: ANN202 - Iterator[ast.AST]
    """Every node under these statements, not entering nested function or class bodies."""
    stack = list(nodes)
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        stack.extend(ast.iter_child_nodes(node))


def _call_name(call: ast.Call) -> str | None:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def _walrus_names(test: ast.expr) -> set[str]:
    return {n.target.id for n in ast.walk(test) if isinstance(n, ast.NamedExpr)}


def _fails(body: list[ast.stmt], bound: set[str] = frozenset()) -> bool:
    """Does this block take a fail path: raise, `Failure`, a side's fail, a refusal?"""
    for node in _walk_no_defs(body):
        if isinstance(node, ast.Raise):
            return True
        if isinstance(node, ast.Call) and _call_name(node) in FAIL_CALLS:
            return True
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Name) \
                and node.value.id in bound:  # `if (f := rule(...)) is not None: return f`
            return True
    # a refusal: the block only skips (`continue`) or gives up (`return None/False`)
    last = body[-1]
    if isinstance(last, ast.Continue):
        return True
    return isinstance(last, ast.Return) and (last.value is None or (
        isinstance(last.value, ast.Constant) and last.value.value in (None, False)))


class _Finder(ast.NodeVisitor):
    def __init__(self, rel: str, src: bytes) -> None:
        self.rel, self.src = rel, src
        self.lines = src.splitlines(keepends=True)
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))
        self.scope: list[str] = []
        self.out: list[Mutant] = []

    def _span(self, node: ast.expr) -> tuple[int, int]:
        return (self.starts[node.lineno - 1] + node.col_offset,
                self.starts[node.end_lineno - 1] + node.end_col_offset)

    def _add(self, node: ast.expr, text: str, kind: str) -> None:
        a, b = self._span(node)
        original = " ".join(self.src[a:b].decode().split())
        self.out.append(Mutant(self.rel, ".".join(self.scope) or "<module>", node.lineno, a, b,
                               original, text, kind))

    def _mutate(self, test: ast.expr, drop: str | None) -> None:
        if drop is not None:
            self._add(test, drop.format(ast.unparse(test)), "drop")
        for op in [n for n in ast.walk(test) if isinstance(n, ast.BoolOp)]:
            neutral = ast.Constant(isinstance(op.op, ast.And))  # one clause of it removed
            for i in range(len(op.values)):
                values = [neutral if j == i else v for j, v in enumerate(op.values)]
                self._add(op, ast.unparse(ast.BoolOp(op=op.op, values=values)), "drop")
        for cmp in [n for n in ast.walk(test) if isinstance(n, ast.Compare)]:
            for i, op in enumerate(cmp.ops):
                if type(op) not in FLIP:
                    continue
                flipped = ast.Compare(left=cmp.left, comparators=cmp.comparators,
                                      ops=[FLIP[type(o)]() if j == i else o
                                           for j, o in enumerate(cmp.ops)])
                self._add(cmp, ast.unparse(flipped), "flip")

    def _scoped(self, node: ast.AST) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def visit_If(self, node: ast.If) -> None:
        bound = _walrus_names(node.test)
        if _fails(node.body, bound):
            self._mutate(node.test, "False and ({})")
        elif node.orelse and not (len(node.orelse) == 1 and isinstance(node.orelse[0], ast.If)) \
                and _fails(node.orelse):
            self._mutate(node.test, "True or ({})")
        self.generic_visit(node)

    def visit_While(self, node: ast.While) -> None:
        if _fails(node.body) or self._fails_after(node):
            self._mutate(node.test, "False and ({})")
        self.generic_visit(node)

    def _fails_after(self, node: ast.While) -> bool:
        """A bounded wait: the statement right after the loop is its fail path."""
        for parent in ast.walk(self.tree):
            for field in ("body", "orelse", "finalbody"):
                block = getattr(parent, field, None)
                if isinstance(block, list) and node in block:
                    i = block.index(node)
                    return i + 1 < len(block) and _fails([block[i + 1]]) \
                        and not isinstance(block[i + 1], ast.Return)
        return False

    def visit_Assert(self, node: ast.Assert) -> None:
        self._mutate(node.test, "True or ({})")
        self.generic_visit(node)

    def visit_Return(self, node: ast.Return) -> None:
        value = node.value  # a returned condition: one with a comparison in it
        if isinstance(value, (ast.Compare, ast.BoolOp)) \
                and any(isinstance(n, ast.Compare) for n in ast.walk(value)):
            self._mutate(value, None)
        self.generic_visit(node)


def find_mutants(root: Path, files: list[str]) -> list[Mutant]:
    out: list[Mutant] = []
    for rel in files:
        src = (root / rel).read_bytes()
        finder = _Finder(rel, src)
        finder.tree = ast.parse(src)
        finder.visit(finder.tree)
        seen = set()
        for m in finder.out:
            if m.key not in seen:
                seen.add(m.key)
                out.append(m)
    return out


def target_files(root: Path) -> list[str]:
    files = []
    for t in TARGETS:
        p = root / t
        files += [str(f.relative_to(root)) for f in sorted(p.rglob("*.py"))] if p.is_dir() \
            else [t]
    ranked = [f for f in PRIORITY if f in files]
    return ranked + [f for f in files if f not in ranked]


# Which tests: the fast ones that import the module or a module that depends on it --------
def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(root: Path, path: Path, known: set[str]) -> set[str]:
    """Modules of the project this file imports (anywhere in it, functions included)."""
    got = set()
    for node in ast.walk(ast.parse(path.read_bytes())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for n in names:
            while n and n not in known:  # `ray_ple.x.y` imports its packages too
                n = n.rpartition(".")[0]
            while n:
                got.add(n)
                n = n.rpartition(".")[0]
    return got


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the project modules it imports (ray_ple and the tests' helpers)."""
    paths = {_module_name(root, p): p for d in ("ray_ple", "tests")
             for p in (root / d).rglob("*.py") if "__pycache__" not in p.parts}
    known = set(paths)
    return {m: _imports(root, p, known) - {m} for m, p in paths.items()}


def tests_for(root: Path, module: str, graph: dict[str, set[str]],
              durations: dict[str, float]) -> list[str]:
    """Test files that reach `module` through imports: the guards' rows first (each made to
    kill one check), then direct importers, then by baseline duration (a kill shows
    soonest)."""
    dependents, frontier = {module}, {module}
    while frontier:
        frontier = {m for m, deps in graph.items() if deps & frontier} - dependents
        dependents |= frontier
    files = [m for m in dependents if m.startswith("tests.test_")]
    paths = {m: str(Path(*m.split(".")).with_suffix(".py")) for m in files}
    return sorted((paths[m] for m in files),
                  key=lambda p: (not p.startswith("tests/test_guards_"),
                                 module not in graph[_module_name(root, root / p)],
                                 durations.get(p, 0.0), p))


# Running ----------------------------------------------------------------------------------
def copy_tree(src: Path, dst: Path, rev: str | None) -> None:
    """The tree to mutate: the commit `rev` (`git archive`, so the pass does not see files
    being edited in the checkout), or with `rev` None the checkout's files as they are."""
    if dst.exists():
        shutil.rmtree(dst)
    if rev is None:
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns(
            ".venv", ".git", "__pycache__", ".pytest_cache", "*.egg-info", ".ruff_cache"))
        return
    dst.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(src), "archive", rev], capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dst)], input=archive, check=True)


# Which tests reach a line: coverage with one context per test --------------------------
# Loaded in every Python process of the coverage run (the copy's pytest, the processes its
# tests spawn, Ray's workers): measures `ray_ple` with the running test's node id as the
# context. pytest's process switches on each test (the plugin below); any other process
# follows the file the plugin writes (polled), so a line run by a child is charged to the
# test that was running then.
_SITECUSTOMIZE = '''
import os
if os.environ.get("MUT_COVRC"):
    import threading
    import time

    import coverage

    POLL = True
    _cov = coverage.Coverage(config_file=os.environ["MUT_COVRC"], data_suffix=True)
    _cov.start()
    _path = os.environ["MUT_CURRENT"]

    def _read():
        try:
            with open(_path) as f:
                return f.read() or "(none)"
        except OSError:
            return "(none)"

    _now = _read()
    _cov.switch_context(_now)

    def _follow():
        global _now
        while POLL:
            time.sleep(0.02)
            new = _read()
            if POLL and new != _now:
                _now = new
                _cov.switch_context(new)

    threading.Thread(target=_follow, daemon=True, name="mutation-coverage").start()
    import atexit
    atexit.register(lambda: (_cov.stop(), _cov.save()))
'''
_PLUGIN = '''
import os

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    import sitecustomize
    sitecustomize.POLL = False  # this process switches by itself, exactly


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_logstart(nodeid, location):
    import sitecustomize
    path = os.environ["MUT_CURRENT"]
    with open(path + ".tmp", "w") as f:
        f.write(nodeid)
    os.replace(path + ".tmp", path)
    if hasattr(sitecustomize, "_cov"):
        sitecustomize._cov.switch_context(nodeid)
'''


def coverage_run(copy: Path, tests: list[str], timeout_s: int, work: Path) -> dict:
    """The unmutated selection once, to its end, under coverage with per-test contexts:
    which tests run each line of the target files (`lines`: file -> line -> node ids), the
    tests that fail unmutated (`broken`, left out of every run) and each test's duration."""
    hook, data = work / "covhook", work / "covdata"
    for d in (hook, data):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    (hook / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    (hook / "mutation_context.py").write_text(_PLUGIN)
    rc = hook / "coveragerc"
    rc.write_text(f"[run]\nsource = {copy / 'ray_ple'}\nparallel = true\n"
                  f"data_file = {data / '.coverage'}\npatch = _exit\n")
    xml = work / "baseline.xml"
    xml.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=f"{hook}:{copy}", PYTHONDONTWRITEBYTECODE="1",
               MUT_COVRC=str(rc), MUT_CURRENT=str(work / "current_test"))
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "mutation_context", "-m", "not slow",
                           f"--timeout={timeout_s}", f"--junitxml={xml}", *tests],
                          cwd=copy, env=env, capture_output=True, text=True)
    took = round(time.monotonic() - t0, 1)
    broken = _failures(xml)
    if proc.returncode != 0 and not broken:
        raise SystemExit(f"the unmutated tests do not run in the copy: {proc.stdout[-3000:]}")
    import coverage  # the pass's own dependency (the `test` extra)

    cov = coverage.Coverage(data_file=str(data / ".coverage"))
    cov.combine([str(data)], keep=False)
    cd = cov.get_data()
    lines: dict[str, dict[str, list[str]]] = {}
    for measured in cd.measured_files():
        rel = str(Path(measured).relative_to(copy))
        by_line = cd.contexts_by_lineno(measured)
        lines[rel] = {str(n): sorted(c for c in ctx if c and c != "(none)")
                      for n, ctx in by_line.items()}
    per_test: dict[str, float] = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        per_test[_node(case)] = float(case.get("time", 0))
    return {"seconds": took, "lines": lines, "per_test": per_test, "broken": broken}


def _statement_line(src: bytes, start: int, end: int) -> int:
    """The first line of the innermost statement holding the byte span."""
    starts = [0]
    for line in src.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    best, line = -1, src.count(b"\n", 0, start) + 1
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.stmt) and not isinstance(node, (
                ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            a = starts[node.lineno - 1] + node.col_offset
            b = starts[node.end_lineno - 1] + node.end_col_offset
            if a <= start and end <= b and a >= best:
                best, line = a, node.lineno
    return line


def covering_tests(copy: Path, m: Mutant, cov: dict) -> list[str]:
    """The tests that ran a line of the mutated expression unmutated: the guards' rows
    first, then the quickest. None ran it: no test can notice the mutant."""
    src = (copy / m.file).read_bytes()
    first, last = src.count(b"\n", 0, m.start) + 1, src.count(b"\n", 0, m.end) + 1
    by_line = cov["lines"].get(m.file, {})
    stmt = _statement_line(src, m.start, m.end)  # a continuation line may have no event
    nodes = {t for n in {stmt, *range(first, last + 1)} for t in by_line.get(str(n), ())}
    nodes -= set(cov["broken"])
    return sorted(nodes, key=lambda t: (not t.startswith("tests/test_guards_"),
                                        cov["per_test"].get(t, 0.0), t))


def tree_digest(root: Path, files: list[str]) -> str:
    h = hashlib.sha1()
    for d in ("ray_ple", "tests"):
        for p in sorted((root / d).rglob("*.py")):
            h.update(str(p.relative_to(root)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:12]


def run_tests(copy: Path, tests: list[str], timeout_s: int, xml: Path,
              deselect: list[str] = (), stop_at_first: bool = True) -> dict:
    """One pytest run in the copy: passed, or the first failing node id."""
    env = dict(os.environ, PYTHONPATH=str(copy), PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, "-m", "pytest", *(["-x"] if stop_at_first else []), "-q", "-p",
           "no:cacheprovider", "-m", "not slow", f"--timeout={timeout_s}", f"--junitxml={xml}",
           *[f"--deselect={d}" for d in deselect], *tests]
    xml.unlink(missing_ok=True)
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True,
                              timeout=timeout_s * 3 + 120)
    except subprocess.TimeoutExpired:
        return {"status": "killed", "by": "(the whole run timed out)", "seconds": None}
    took = round(time.monotonic() - t0, 1)
    first, noise = _first_failure(xml)
    if proc.returncode == 0:
        return {"status": "survived", "by": "", "seconds": took}
    if first is None and noise:  # only the session's leftovers check failed: not the mutant's
        return {"status": "noise", "by": noise, "seconds": took,
                "tail": proc.stdout[-2000:]}
    return {"status": "killed", "by": first or f"(pytest exit {proc.returncode})",
            "seconds": took, "tail": proc.stdout[-1500:]}


def _failures(xml: Path) -> list[str]:
    """Every test that failed or errored (setup, call, teardown) in a junit XML."""
    out = []
    for case in ET.parse(xml).getroot().iter("testcase") if xml.exists() else ():
        if case.findall("failure") or case.findall("error"):
            out.append(_node(case))
    return out


def _node(case: ET.Element) -> str:
    cls = case.get("classname", "")
    path = case.get("file") or cls.replace(".", "/") + ".py"
    return f"{path}::{case.get('name')}"


def _first_failure(xml: Path) -> tuple[str | None, str | None]:
    """(first test that failed or errored in setup/call, a teardown-only error if that was
    all), from pytest's junit XML."""
    if not xml.exists():
        return None, None
    noise = None
    for case in ET.parse(xml).getroot().iter("testcase"):
        node = _node(case)
        for bad in list(case.findall("failure")) + list(case.findall("error")):
            msg = bad.get("message", "")
            if bad.tag == "error" and msg.startswith("failed on teardown"):
                noise = noise or f"{node} (teardown: {msg[:120]})"
                continue
            return f"{node} ({msg.splitlines()[0][:100] if msg else bad.tag})", None
    return None, noise


def apply(copy: Path, m: Mutant) -> bytes:
    path = copy / m.file
    orig = path.read_bytes()
    new = orig[:m.start] + m.mutant.encode() + orig[m.end:]
    compile(new, str(path), "exec")  # a mutant that does not compile is a bug of this script
    path.write_bytes(new)
    return orig


def run_mutant(copy: Path, m: Mutant, tests: list[str], timeout_s: int, work: Path,
               broken: list[str], confirm: bool = True) -> dict:
    """Apply, run, restore. A kill is confirmed by running the killing test alone on the
    restored tree: a test that fails there too failed for another reason (the host's memory
    moved by another session, say); it is deselected and the mutant runs again."""
    deselect, flaky = list(broken), []
    for _ in range(3):
        orig = apply(copy, m)
        try:
            res = run_tests(copy, tests, timeout_s, work / "run.xml", deselect)
            if res["status"] == "noise":  # the leftovers check saw another session's
                res = run_tests(copy, tests, timeout_s, work / "run.xml", deselect)
        finally:
            (copy / m.file).write_bytes(orig)
        if res["status"] != "killed" or " (" not in res["by"] or not confirm:
            break
        node = res["by"].split(" (")[0]
        if run_tests(copy, [node], timeout_s, work / "confirm.xml")["status"] == "survived":
            break  # passes unmutated: the mutant's kill
        deselect.append(node)
        flaky.append(node)
        res = {"status": "survived?", "by": f"only flaky kills: {flaky}", "seconds": None}
    return res | ({"flaky": flaky} if flaky else {})


# The table --------------------------------------------------------------------------------
def _cell(s: str) -> str:
    return "`" + s.replace("|", "\\|").replace("`", "'") + "`"


def write_table(out: Path, mutants: list[Mutant], results: dict[str, dict], meta: dict) -> None:
    rows = ["| id | file:line (function) | original | mutant | result | killing test, or why "
            "equivalent |", "|---|---|---|---|---|---|"]
    counts: dict[str, int] = {}
    for m in mutants:
        r = results.get(m.id)
        status = r["status"] if r else "not run"
        note = r["by"] if r and status == "killed" else ""
        if status == "survived" and m.key in EQUIVALENT:
            status, note = "equivalent", EQUIVALENT[m.key]
        elif status == "survived":
            note = "**unexplained**"
        counts[status] = counts.get(status, 0) + 1
        rows.append(f"| {m.id} | {m.file}:{m.line} ({m.function}) | {_cell(m.original)} | "
                    f"{_cell(m.mutant)} | {status} | {note.replace('|', '/')} |")
    summary = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
    head = (f"Ran on commit {meta['commit']} (tree digest {meta['digest']}), "
            f"{meta['when']}: {len(mutants)} mutants, {summary}.\n"
            + (f"Left out of every run, failing unmutated on that machine: "
               f"{', '.join(meta['broken'])}.\n" if meta["broken"] else "") + "\n")
    block = f"{MARK_START}\n{head}" + "\n".join(rows) + f"\n{MARK_END}"
    text = out.read_text() if out.exists() else f"# Mutation pass\n\n{MARK_START}\n{MARK_END}\n"
    if MARK_START not in text:
        text += f"\n{MARK_START}\n{MARK_END}\n"
    a, b = text.index(MARK_START), text.index(MARK_END) + len(MARK_END)
    out.write_text(text[:a] + block + text[b:])


def _commit(src: Path, rev: str | None) -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", rev or "HEAD"], cwd=src,
                              text=True, capture_output=True, check=True).stdout.strip()
        if rev is not None:
            return head
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "ray_ple", "tests"],
                               cwd=src, text=True, capture_output=True).stdout.strip()
        return head + (" + uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def earlier_table(out: Path) -> dict[str, dict]:
    """Killed rows of the table already in `out`, by id: an id is its mutant's key (file,
    function, original, mutant), so a row whose id the tree still yields is that mutant."""
    got = {}
    if not out.exists():
        return got
    for row in out.read_text().splitlines():
        cells = [c.strip() for c in row.split(" | ")]
        if row.startswith("| ") and len(cells) >= 6 and cells[4] == "killed":
            got[cells[0].lstrip("| ")] = {"status": "killed", "by": cells[5].rstrip(" |"),
                                          "seconds": None, "from": "the earlier pass"}
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", type=Path, default=ROOT, help="repository to copy (default: this)")
    ap.add_argument("--rev", default="HEAD",
                    help="commit to mutate (git archive); 'worktree': the files as they are")
    ap.add_argument("--work", type=Path, default=Path("/tmp/ray-ple-mutation"),
                    help="scratch directory: the copy, results.jsonl, coverage.json")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "mutation.md")
    ap.add_argument("--files", nargs="*", help="only these target files (repo-relative)")
    ap.add_argument("--only", nargs="*", help="only these mutant ids")
    ap.add_argument("--list", action="store_true", help="print the mutants and stop")
    ap.add_argument("--table", action="store_true",
                    help="write the table from the results so far and stop (with --no-copy)")
    ap.add_argument("--resume", action="store_true",
                    help="keep results of an earlier run, and the killed rows of --out's table")
    ap.add_argument("--timeout", type=int, default=120, help="per test (pytest-timeout)")
    ap.add_argument("--budget-min", type=float, default=0,
                    help="stop starting mutants after this many minutes (0: no limit)")
    ap.add_argument("--no-copy", action="store_true", help="reuse the copy in --work")
    ap.add_argument("--no-confirm", action="store_true",
                    help="take a kill as it is (default: the killing test is run again alone "
                         "on the restored tree; one that fails there too is deselected)")
    args = ap.parse_args()
    for sig in (signal.SIGTERM, signal.SIGINT):  # stopped mid-mutant: restore, then exit
        signal.signal(sig, signal.default_int_handler)

    src, work = args.src.resolve(), args.work.resolve()
    rev = None if args.rev == "worktree" else args.rev
    if work == src or src in work.parents:
        raise SystemExit("--work must be outside the tree: the checkout is never mutated")
    copy = work / "src"
    work.mkdir(parents=True, exist_ok=True)
    if not args.no_copy or not copy.exists():
        copy_tree(src, copy, rev)
    files = args.files or target_files(copy)
    mutants = find_mutants(copy, files)
    if args.list:
        for m in mutants:
            print(f"{m.id} {m.file}:{m.line} ({m.function}) {m.kind}: {m.original!r} -> "
                  f"{m.mutant!r}")
        print(f"{len(mutants)} mutants in {len(files)} files")
        return
    check = subprocess.run([sys.executable, "-c", "import ray_ple; print(ray_ple.__file__)"],
                           cwd=copy, env=dict(os.environ, PYTHONPATH=str(copy)),
                           capture_output=True, text=True)
    if not check.stdout.strip().startswith(str(copy)):
        raise SystemExit(f"ray_ple resolves to {check.stdout.strip()!r}, not the copy")
    digest = tree_digest(copy, files)
    results_path = work / "results.jsonl"
    results: dict[str, dict] = {}  # the latest run of each mutant
    done: set[str] = set()  # mutants already run on this very tree
    if args.resume:
        ids = {m.id for m in mutants}
        for i, r in earlier_table(args.out).items():
            if i in ids:
                results[i] = r
                done.add(i)
    if (args.resume or args.only or args.table) and results_path.exists():
        for line in results_path.read_text().splitlines():
            r = json.loads(line)
            results[r["id"]] = r
            if r.get("digest") == digest or args.resume:  # --resume: whatever tree ran it
                done.add(r["id"])
    elif results_path.exists():
        results_path.unlink()

    cov_path = work / "coverage.json"
    if args.table:
        base = json.loads(cov_path.read_text())
        meta = {"commit": base["commit"], "digest": digest, "broken": base["broken"],
                "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        write_table(args.out, mutants, results, meta)
        print(f"table: {args.out}")
        return
    todo = [m for m in mutants if (not args.only or m.id in args.only)
            and (args.only or m.id not in done)]
    # every check dropped first (does it matter at all?), then the boundaries; by PRIORITY
    todo.sort(key=lambda m: (m.kind != "drop", files.index(m.file), m.start))
    base = json.loads(cov_path.read_text()) \
        if cov_path.exists() and (args.resume or args.only) else None
    if todo and (base is None or base.get("digest") != digest):
        graph = import_graph(copy)
        union = sorted({t for f in {m.file for m in todo} for t in tests_for(
            copy, _module_name(copy, copy / f), graph, {})})
        print(f"coverage: {len(union)} test files, unmutated", flush=True)
        base = coverage_run(copy, union, args.timeout, work) | {
            "digest": digest, "commit": _commit(src, rev)}
        cov_path.write_text(json.dumps(base))
        print(f"coverage run: {base['seconds']} s, {len(base['per_test'])} tests, "
              f"{len(base['broken'])} failing unmutated", flush=True)
    meta = {"commit": (base or {}).get("commit") or _commit(src, rev), "digest": digest,
            "broken": base["broken"] if base else [],
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    start = time.monotonic()
    with results_path.open("a") as log:
        for n, m in enumerate(todo, 1):
            if args.budget_min and time.monotonic() - start > args.budget_min * 60:
                print(f"budget spent: {len(todo) - n + 1} mutants not run", flush=True)
                break
            tests = covering_tests(copy, m, base)
            if not tests:
                res = {"status": "survived", "by": "(no test runs this line)", "seconds": 0,
                       "uncovered": True}
            else:
                res = run_mutant(copy, m, tests, args.timeout, work, base["broken"],
                                 confirm=not args.no_confirm)
            results[m.id] = rec = asdict(m) | res | {"id": m.id, "digest": digest,
                                                     "selected": len(tests)}
            log.write(json.dumps(rec) + "\n")
            log.flush()
            print(f"[{n}/{len(todo)}] {m.id} {m.file}:{m.line} {m.original!r} -> "
                  f"{m.mutant!r}: {res['status']} {res['by']} ({res['seconds']} s, "
                  f"{len(tests)} tests)", flush=True)
    write_table(args.out, mutants, results, meta)
    survived = [m for m in mutants if results.get(m.id, {}).get("status") == "survived"
                and m.key not in EQUIVALENT]
    print(f"table: {args.out}; {len(survived)} unexplained survivors", flush=True)
    for m in survived:
        print(f"  survived {m.id} {m.key} {results[m.id]['by']}")


if __name__ == "__main__":
    main()
