"""The Grafana dashboard queries only what ray-ple exports, under the names Ray gives them.

The names are read from `ray_ple/supervision/metrics.py`'s own definitions (each
`metrics.Counter(...)` / `metrics.Histogram(...)` call), then given what Ray's endpoint adds:
the `ray_` prefix, `_total` on a counter that lacks it, `_bucket`/`_sum`/`_count` on a
histogram. The served test (`tests/test_serve.py`) checks that a real `serve run` exports them.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

from ray_ple.supervision import metrics

REPO = Path(__file__).resolve().parent.parent
DASHBOARD = REPO / "dashboards" / "ray-ple-grafana.json"
# PromQL words and the label names these queries group by: what is left is a metric name
PROMQL_WORDS = {"sum", "avg", "min", "max", "count", "rate", "irate", "increase",
                "histogram_quantile", "by", "without", "ignoring", "on", "group_left",
                "group_right", "label_values", "le"}


def defined_metrics() -> set[str]:
    """Every series name metrics.py's definitions have on Ray's endpoint."""
    tree = ast.parse(Path(metrics.__file__).read_text())
    names = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("Counter", "Histogram", "Gauge")):
            continue
        arg = node.args[0]
        name = arg.value if isinstance(arg, ast.Constant) else getattr(metrics, arg.id)
        name = "ray_" + name
        if node.func.attr == "Counter":
            names.add(name if name.endswith("_total") else name + "_total")
        elif node.func.attr == "Histogram":
            names |= {name + s for s in ("_bucket", "_sum", "_count")}
        else:
            names.add(name)
    return names


def load() -> dict:
    return json.loads(DASHBOARD.read_text())


def queries(dash: dict) -> list[str]:
    """Every PromQL expression of the dashboard: panels' targets and query variables."""
    out = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    out += [v["query"]["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    return out


def metric_names(expr: str) -> set[str]:
    """The metric names one PromQL expression reads."""
    expr = re.sub(r"\{[^}]*\}", " ", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", " ", expr)  # ranges
    expr = re.sub(r"\b(by|ignoring|without|on)\s*\([^)]*\)", " ", expr)  # grouping labels
    expr = re.sub(r"label_values\(\s*([a-zA-Z_:][\w:]*)\s*,\s*\w+\s*\)", r" \1 ", expr)
    words = set(re.findall(r"[a-zA-Z_:][\w:]*", expr))
    return words - PROMQL_WORDS


def dashboard_metrics() -> set[str]:
    """Every metric name any query of the dashboard reads."""
    return set().union(*(metric_names(q) for q in queries(load())))


def test_every_query_names_only_metrics_ray_ple_defines():
    defined = defined_metrics()
    assert defined == metrics.exported_names()  # the module's own list agrees
    for expr in queries(load()):
        names = metric_names(expr)
        assert names, f"no metric in {expr!r}"
        assert names <= defined, f"{sorted(names - defined)} in {expr!r} not defined"
    assert not any(n.startswith("ray_ray_") for n in defined)


def test_every_metric_has_a_panel():
    families = {re.sub(r"_(bucket|sum|count)$", "", n) for n in defined_metrics()}
    shown = {re.sub(r"_(bucket|sum|count)$", "", n) for n in dashboard_metrics()}
    assert families == shown


def test_the_dashboard_is_grafana_json_on_the_datasource_variable():
    dash = load()
    assert dash["title"] and dash["uid"] and isinstance(dash["schemaVersion"], int)
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for v in variables.values():
        if v["type"] == "query":
            assert v["datasource"] == "${datasource}"
    assert dash["panels"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        assert p["datasource"] == "${datasource}", p["title"]
        assert p["type"] and p["title"] and set(p["gridPos"]) == {"x", "y", "w", "h"}
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
            # every variable a query uses is defined ($__ names are Grafana's own)
            used = set(re.findall(r"\$(\w+)", t["expr"])) - {"__all"}
            assert used <= set(variables), (p["title"], used - set(variables))


def test_tokens_bucket():
    assert [metrics.tokens_bucket(t) for t in (1, 2, 4, 5, 4096, 4097)] == [
        "1", "4", "4", "16", "4096", "+Inf"]
