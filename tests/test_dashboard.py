"""deploy/grafana/cortex-dashboard.json: well formed, every query parses, every metric it queries exists.

The metric names come out of each panel's PromQL through a small PromQL lexer (`metric_names`: strings, label
matchers, ranges, function and aggregation names, grouping label lists, keywords and Grafana variables are
not metric names), tested with vectors. The names are then looked up, exactly as written (`_bucket`, `_sum`,
`_count`, `_total` included), among the samples a real gateway exposes after JSON and SSE chats, a bad request
and a refused model: ingest's /metrics (which serves every extproc process's series too) and, when the
gateway's config has an `observe` section, the observer's. The alert rules' metrics are checked the same way.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from extproc.policies.base import MODES
from ingest.sync import SyncState
from observe.entry import CAUSES, OUTCOMES
from tests.harness import MODEL, Gateway, cluster, long_chat, wait_for

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "cortex-dashboard.json"
RULES = ROOT / "deploy" / "prometheus" / "cortex-alerts.yaml"

# The observation's series (`cortex observe`, docs/observability.md), ingest's KV usage gauge and extproc's
# routing-gain baseline, checked apart (test_observer_metrics_exist) from what was there before them.
OBSERVATION = frozenset({
    "cortex_ttft_seconds", "cortex_itl_seconds", "cortex_e2e_seconds", "cortex_requests_total",
    "cortex_request_errors_total", "cortex_prompt_tokens_total", "cortex_completion_tokens_total",
    "cortex_engine_cached_tokens_total", "cortex_observed_claimed_hit_tokens_total", "cortex_claim_check_total",
    "cortex_claim_error_tokens_total", "cortex_observer_entries_total", "cortex_target_kv_usage_ratio",
    "cortex_random_choice_hit_tokens_total",
})
# Series Prometheus makes itself (never on a target's /metrics).
SYNTHETIC = frozenset({"up", "scrape_duration_seconds", "scrape_samples_scraped"})

# --- PromQL names ------------------------------------------------------------------------------------------

_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool", "and",
                       "or", "unless", "atan2", "inf", "nan", "start", "end"})
_GROUPING = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
_TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<comment>\#[^\n]*)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<var>\$\{[^}]*\}|\$[A-Za-z_][A-Za-z0-9_]*)
  | (?P<number>(?:0x[0-9a-fA-F]+|\d[\d.]*(?:[eE][+-]?\d+)?)(?:[a-zA-Z]+\d*[a-zA-Z]*)*)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<punct>[{}()\[\],@]|[-+*/%^]|[=!<>]=|=~|!~|[<>=])
""", re.VERBOSE)


class PromQLError(ValueError):
    pass


def _tokens(expr: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if m is None:
            raise PromQLError(f"cannot lex {expr[pos:pos + 20]!r} in {expr!r}")
        pos = m.end()
        kind = m.lastgroup
        assert kind is not None
        if kind not in ("ws", "comment"):
            out.append((kind, m.group()))
    return out


def _closing(toks: list[tuple[str, str]], i: int, open_: str, close: str) -> int:
    """Index of the token closing the bracket opened at toks[i]."""
    depth = 0
    for j in range(i, len(toks)):
        if toks[j] == ("punct", open_):
            depth += 1
        elif toks[j] == ("punct", close):
            depth -= 1
            if depth == 0:
                return j
    raise PromQLError(f"unbalanced {open_!r}")


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects, as written (suffixes kept). Function and aggregation names (an
    identifier followed by `(`), keywords, label names in matchers and grouping lists, strings, durations and
    Grafana variables are not; a matcher block without a name contributes its `__name__="..."` if it has one."""
    toks = _tokens(expr)
    names: set[str] = set()
    i = 0
    while i < len(toks):
        kind, text = toks[i]
        nxt = toks[i + 1] if i + 1 < len(toks) else ("", "")
        if (kind, text) == ("punct", "{"):
            end = _closing(toks, i, "{", "}")
            block = toks[i + 1:end]
            for k in range(len(block) - 2):
                if block[k] == ("ident", "__name__") and block[k + 1] == ("punct", "=") and block[k + 2][0] == "string":
                    names.add(block[k + 2][1][1:-1])
            i = end + 1
        elif (kind, text) == ("punct", "["):
            i = _closing(toks, i, "[", "]") + 1
        elif kind == "ident" and text.lower() in _GROUPING:
            # by (a, b) / on (a) / group_left (c) / group_left with no list
            i = _closing(toks, i + 1, "(", ")") + 1 if nxt == ("punct", "(") else i + 1
        elif kind == "ident" and (nxt == ("punct", "(") or (nxt[0] == "ident" and nxt[1].lower() in ("by", "without"))):
            i += 1  # a function, or an aggregation (`sum(...)`, `sum by (l) (...)`)
        elif kind == "ident" and text.lower() not in _KEYWORDS:
            names.add(text)
            if nxt == ("punct", "{"):  # the name's own matchers
                i = _closing(toks, i + 1, "{", "}") + 1
            else:
                i += 1
        else:
            i += 1
    return names


_MATCH_OPS = frozenset({"=", "!=", "=~", "!~"})


def _matcher_labels(block: list[tuple[str, str]]) -> frozenset[str]:
    """Label names a matcher block `{a="x", b=~"y"}` (its tokens, braces excluded) filters on."""
    return frozenset(text for k, (kind, text) in enumerate(block[:-1])
                     if kind == "ident" and block[k + 1][0] == "punct" and block[k + 1][1] in _MATCH_OPS
                     and text != "__name__")


def selectors(expr: str) -> set[tuple[str, frozenset[str]]]:
    """(metric name, the label names its matchers filter on) for every series selector of an expression."""
    toks = _tokens(expr)
    names = metric_names(expr)
    found: set[tuple[str, frozenset[str]]] = set()
    i = 0
    while i < len(toks):
        kind, text = toks[i]
        if kind == "ident" and text in names and toks[i + 1:i + 2] == [("punct", "{")]:
            end = _closing(toks, i + 1, "{", "}")
            found.add((text, _matcher_labels(toks[i + 2:end])))
            i = end + 1
            continue
        if kind == "ident" and text in names and toks[i + 1:i + 2] != [("punct", "(")]:
            found.add((text, frozenset()))
        elif (kind, text) == ("punct", "{") and (i == 0 or toks[i - 1][0] != "ident"):
            end = _closing(toks, i, "{", "}")
            block = toks[i + 1:end]
            for k in range(len(block) - 2):
                if block[k] == ("ident", "__name__") and block[k + 1] == ("punct", "="):
                    found.add((block[k + 2][1][1:-1], _matcher_labels(block)))
            i = end + 1
            continue
        i += 1
    return found


def grouping_labels(expr: str) -> set[str]:
    """Label names in `by`, `without`, `on`, `ignoring`, `group_left` and `group_right` lists."""
    toks = _tokens(expr)
    found: set[str] = set()
    for i, (kind, text) in enumerate(toks):
        if kind == "ident" and text.lower() in _GROUPING and toks[i + 1:i + 2] == [("punct", "(")]:
            end = _closing(toks, i + 1, "(", ")")
            found |= {t for k, t in toks[i + 2:end] if k == "ident"}
    return found


_SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")


def family(name: str) -> str:
    """The metric family a sample name belongs to (what `# TYPE` names)."""
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


@pytest.mark.parametrize(("expr", "names"), [
    ("up", {"up"}),
    ('sum by (model, le) (rate(cortex_ttft_seconds_bucket{model=~"$model", worker=~"a|b"}[$__rate_interval]))',
     {"cortex_ttft_seconds_bucket"}),
    ("histogram_quantile(0.9, sum by (le) (rate(x_bucket[5m] offset 1h)))", {"x_bucket"}),
    ("sum(rate(a_total[5m])) / sum without (instance) (rate(b_total[5m])) > 0.5", {"a_total", "b_total"}),
    ("a + on (instance, target) group_left (state) b and ignoring (x) c unless d or e", {"a", "b", "c", "d", "e"}),
    ("a + on () group_left () (sum(rate(b[10m])) or vector(0))", {"a", "b"}),
    ('{__name__="via_matcher", job="cortex"}', {"via_matcher"}),
    ('count(label_replace(m{l="by (x)"}, "dst", "$1", "src", "(.*)"))', {"m"}),
    ("time() - start_time_seconds", {"start_time_seconds"}),
    ("sum(rate(x[5m:1m])) by (instance) * 1e3 + -Inf", {"x"}),
    ("max_over_time(deriv(x[1h])[1d:5m]) @ end()", {"x"}),
    ("changes(ingest_start[15m]) > bool 0", {"ingest_start"}),
    ('avg({__name__=~"re.*"}) + nan', set()),
    ("${datasource_var} + $worker", set()),
])
def test_metric_names(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


@pytest.mark.parametrize(("name", "fam"), [("a_seconds_bucket", "a_seconds"), ("a_total", "a"), ("a_ratio", "a_ratio"),
                                           ("a_seconds_count", "a_seconds"), ("a_seconds_sum", "a_seconds")])
def test_family(name: str, fam: str) -> None:
    assert family(name) == fam


@pytest.mark.parametrize(("expr", "found"), [
    ("up", {("up", frozenset())}),
    ('sum by (model, le) (rate(x_bucket{model=~"$model", worker=~"a|b"}[5m])) / y{job="c"}',
     {("x_bucket", frozenset({"model", "worker"})), ("y", frozenset({"job"}))}),
    ('a{l="by (x)"} + on (instance) group_left (state) b', {("a", frozenset({"l"})), ("b", frozenset())}),
    ('{__name__="via_matcher", job="cortex"}', {("via_matcher", frozenset({"job"}))}),
    ("time() - start_time_seconds", {("start_time_seconds", frozenset())}),
])
def test_selectors(expr: str, found: set[tuple[str, frozenset[str]]]) -> None:
    assert selectors(expr) == found


@pytest.mark.parametrize(("expr", "labels"), [
    ("sum by (model, le) (rate(x[5m]))", {"model", "le"}),
    ("a + on (instance, target) group_left (state) b and ignoring (x) c", {"instance", "target", "state", "x"}),
    ("a + on () group_left () (sum(rate(b[10m])) or vector(0))", set()),
    ('sum without (instance) (a{l="by (x)"})', {"instance"}),
])
def test_grouping_labels(expr: str, labels: set[str]) -> None:
    assert grouping_labels(expr) == labels


def test_unbalanced_expression_is_an_error() -> None:
    with pytest.raises(PromQLError):
        metric_names("sum(rate(x{a=\"b\"[5m]))")


# --- The dashboard itself ----------------------------------------------------------------------------------


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels(dash: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for p in dash["panels"]:
        yield p
        yield from p.get("panels", [])  # a collapsed row holds its panels


def queries(dash: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) for every query of every panel."""
    return [(p["title"], t["expr"]) for p in panels(dash) for t in p.get("targets", [])]


def rule_queries() -> list[tuple[str, str]]:
    doc = yaml.safe_load(RULES.read_text())
    return [(r.get("alert") or r["record"], r["expr"]) for g in doc["groups"] for r in g["rules"]]


def test_dashboard_is_well_formed() -> None:
    dash = dashboard()
    assert 39 <= dash["schemaVersion"] < 42 and dash["uid"] and dash["title"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for name in ("model", "worker"):
        v = variables[name]
        assert v["type"] == "query" and v["includeAll"] and v["multi"] and v["allValue"] == ".*"
        assert v["datasource"]["uid"] == "${datasource}"
    ids = [p["id"] for p in panels(dash)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in panels(dash):
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p.get("description"), f"{p['title']}: say what the panel shows"
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}" and t["expr"].strip(), p["title"]
    # The panels the issue asks for.
    titles = " | ".join(p["title"].lower() for p in panels(dash))
    for needle in ("hit ratio", "routing gain", "ttft p90 per worker", "inter-token", "load skew", "fallback reasons",
                   "ledger state", "gaps", "decision time", "routing stage", "errors by cause", "claim check"):
        assert needle in titles, needle


def _grafana_to_promql(expr: str) -> str:
    """Grafana's variables replaced by values Prometheus accepts, so promtool can parse the query."""
    for var, value in (("$__rate_interval", "5m"), ("$__range", "3h"), ("$__interval", "1m"),
                       ("${datasource}", ""), ("$model", ".*"), ("$worker", ".*")):
        expr = expr.replace(var, value)
    assert "$" not in expr, expr
    return expr


def prometheus_tool(name: str) -> str:
    """scripts/setup.sh puts `promtool` and `prometheus` beside the venv's python; else the ones on PATH. Missing
    fails: CI runs them."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} not found: run scripts/setup.sh (scripts/install-prometheus.sh puts it in .venv/bin)")
    return found


def promtool() -> str:
    return prometheus_tool("promtool")


def test_every_dashboard_query_parses(tmp_path: Path) -> None:
    """promtool parses every panel's query (as a recording rule) with Grafana's variables filled in."""
    rules = [{"record": f"dashboard:query_{i}", "expr": _grafana_to_promql(expr)}
             for i, (_, expr) in enumerate(queries(dashboard()))]
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    r = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_query_names_a_metric() -> None:
    for title, expr in queries(dashboard()) + rule_queries():
        assert metric_names(expr), f"{title}: {expr}"
        for name in metric_names(expr):
            assert name.startswith("cortex_") or name in SYNTHETIC, f"{title}: {name}"


def test_histograms_are_queried_through_their_buckets() -> None:
    for title, expr in queries(dashboard()) + rule_queries():
        if "histogram_quantile" in expr:
            assert any(n.endswith("_bucket") for n in metric_names(expr)), f"{title}: {expr}"
        for name in metric_names(expr):
            assert not name.endswith("_created"), f"{title}: {name}"


# --- Against a running gateway -----------------------------------------------------------------------------


def _chat(gw: Gateway, messages: list[dict[str, str]], stream: bool) -> None:
    body: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 6}
    if not stream:
        r = httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return
    body["stream"] = True
    chunks = 0
    with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                orjson.loads(line[6:])
                chunks += 1
    assert chunks >= 2


def scrape_targets(gw: Gateway) -> list[str]:
    urls = [f"{gw.ingest_url}/metrics"]
    observe = gw.config().get("observe")
    if isinstance(observe, dict) and observe.get("http_port"):
        urls.append(f"http://127.0.0.1:{observe['http_port']}/metrics")
    return urls


def exposition(gw: Gateway) -> dict[str, str]:
    """Sample name -> its family's type, over every scrape target of the gateway."""
    samples: dict[str, str] = {}
    for url in scrape_targets(gw):
        r = httpx.get(url, timeout=10)
        assert r.status_code == 200, url
        for fam in text_string_to_metric_families(r.text):
            for s in fam.samples:
                samples[s.name] = fam.type
    return samples


def exposed_label_sets(gw: Gateway) -> dict[str, set[frozenset[str]]]:
    """Sample name -> every set of label names its samples carry, over every scrape target of the gateway."""
    found: dict[str, set[frozenset[str]]] = {}
    for url in scrape_targets(gw):
        r = httpx.get(url, timeout=10)
        assert r.status_code == 200, url
        for fam in text_string_to_metric_families(r.text):
            for s in fam.samples:
                found.setdefault(s.name, set()).add(frozenset(s.labels))
    return found


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with cluster(tmp_path_factory.mktemp("dash")) as g:
        for seed in (3, 4):  # each prompt twice: a miss, then a hit on the worker that cached it
            for stream in (False, True, False, True):
                _chat(g, long_chat(300, seed=seed), stream)
        bad = httpx.post(f"{g.url}/v1/chat/completions", content=b"{not json", timeout=30,
                         headers={"content-type": "application/json"})
        assert bad.status_code == 400
        unknown = httpx.post(f"{g.url}/v1/chat/completions", json={"model": "no-such-model", "messages": []},
                             timeout=30)
        assert unknown.status_code >= 400
        yield g


@pytest.fixture(scope="module")
def exposed(gw: Gateway) -> dict[str, str]:
    # The extproc processes write their samples when a request ends: wait until the chats' decisions show.
    wait_for(lambda: "cortex_route_stage_seconds_bucket" in exposition(gw), what="extproc's series in /metrics")
    return exposition(gw)


def _missing(exposed: dict[str, str], observation: bool) -> dict[str, list[str]]:
    missing: dict[str, list[str]] = {}
    for title, expr in queries(dashboard()) + rule_queries():
        for name in sorted(metric_names(expr) - SYNTHETIC):
            if (name in OBSERVATION or family(name) in OBSERVATION) == observation and name not in exposed:
                missing.setdefault(name, []).append(title)
    if missing:
        print("queried but not exposed by the gateway:")
        for name, where in sorted(missing.items()):
            print(f"  {name} (family {family(name)}): {', '.join(sorted(set(where)))}")
    return missing


def test_existing_metrics_exist(exposed: dict[str, str]) -> None:
    missing = _missing(exposed, observation=False)
    assert not missing, f"queried but not exposed: {sorted(missing)}"


def test_observer_metrics_exist(exposed: dict[str, str]) -> None:
    """The observation's series (`cortex observe`, ingest's KV usage, extproc's routing-gain baseline)."""
    missing = _missing(exposed, observation=True)
    assert not missing, f"queried but not exposed: {sorted(missing)}"


def test_suffixes_match_the_exposed_types(exposed: dict[str, str]) -> None:
    """A `_bucket` query reads a histogram; a `_total` query reads a counter (what rate() and increase() need)."""
    for title, expr in queries(dashboard()) + rule_queries():
        for name in metric_names(expr):
            kind = exposed.get(name)
            if kind is None:
                continue  # reported by the tests above
            if name.endswith("_bucket"):
                assert kind == "histogram", f"{title}: {name} is a {kind}"
            elif name.endswith("_total"):
                assert kind == "counter", f"{title}: {name} is a {kind}"


# Labels Prometheus adds to every series of a target (the alert rules and their tests use them; no exporter emits
# them).
TARGET_LABELS = frozenset({"instance", "job"})


@pytest.fixture(scope="module")
def exposed_labels(gw: Gateway, exposed: dict[str, str]) -> dict[str, set[frozenset[str]]]:
    return exposed_label_sets(gw)


def test_queried_labels_are_exposed(exposed_labels: dict[str, set[frozenset[str]]]) -> None:
    """Every label a query filters or groups by is on the series it reads: a filter on a label the exporter does not
    emit matches nothing (a dashboard panel goes empty once a value is picked), a grouping by one merges what it
    should split."""
    wrong = []
    for title, expr in queries(dashboard()) + rule_queries():
        carried: set[str] = set(TARGET_LABELS)
        for name, labels in sorted(selectors(expr)):
            if name in SYNTHETIC or name not in exposed_labels:
                continue  # Prometheus's own series; a missing name is reported by the tests above
            sets = exposed_labels[name]
            carried |= set().union(*sets)
            if not any(labels - TARGET_LABELS <= have for have in sets):
                wrong.append(f"{title}: {name} filtered by {sorted(labels)}, exposed with {sorted(map(sorted, sets))}")
        missing = grouping_labels(expr) - carried
        if missing and any(n not in SYNTHETIC for n in metric_names(expr)):
            wrong.append(f"{title}: grouped by {sorted(missing)}, which none of its series carries")
    assert not wrong, "\n".join(dict.fromkeys(wrong))


ALERT_TESTS = RULES.with_name("cortex-alerts.test.yaml")
# Label values the code draws from a fixed set: a synthetic series with any other value tests a series that cannot
# exist.
ENUMERATED = {"state": {s.value for s in SyncState}, "outcome": set(OUTCOMES), "cause": set(CAUSES) - {""},
              "mode": set(MODES)}


def alert_test_series() -> list[tuple[str, dict[str, str]]]:
    """(name, labels) of every input series of the promtool tests."""
    out = []
    for case in yaml.safe_load(ALERT_TESTS.read_text())["tests"]:
        for series in case.get("input_series", []):
            toks = _tokens(series["series"])
            assert toks[0][0] == "ident" and toks[1] == ("punct", "{") and toks[-1] == ("punct", "}"), series
            body = toks[2:-1]
            labels = {body[k][1]: body[k + 2][1][1:-1] for k in range(0, len(body), 4)}
            out.append((toks[0][1], labels))
    return out


def test_alert_test_series_are_real(exposed_labels: dict[str, set[frozenset[str]]]) -> None:
    """The promtool tests' synthetic series carry exactly the label names a real gateway's series of the same name
    carry (plus the target's job and instance), with values the code can produce: a test whose series carry a
    label the exporter lacks passes while the alert it tests can never fire."""
    wrong = []
    for name, labels in alert_test_series():
        if name in SYNTHETIC:
            assert set(labels) == TARGET_LABELS, (name, labels)
            continue
        if name not in exposed_labels:
            wrong.append(f"{name}: no such series on a real gateway")
            continue
        names = frozenset(labels) - TARGET_LABELS
        if set(labels) & TARGET_LABELS != TARGET_LABELS or names not in exposed_labels[name]:
            wrong.append(f"{name}{sorted(labels)}: a real scrape has {sorted(map(sorted, exposed_labels[name]))} "
                         "(+ job, instance)")
        for label, allowed in ENUMERATED.items():
            if label in labels and labels[label] not in allowed:
                wrong.append(f"{name}: {label}={labels[label]!r} is none of {sorted(allowed)}")
    assert not wrong, "\n".join(dict.fromkeys(wrong))


def _value(gw: Gateway, name: str, **labels: str) -> float | None:
    r = httpx.get(f"{gw.ingest_url}/metrics", timeout=5)
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return None


@pytest.mark.parametrize("child", ["extproc", "ingest"])
def test_a_restart_shows_as_a_new_start_time(gw: Gateway, exposed: dict[str, str], child: str) -> None:
    """The series CortexExtprocRestarting and CortexIngestRestarting watch move when the supervisor restarts
    a child (and only the restarted child's)."""
    ext = ("cortex_extproc_start_time_seconds", {"process": "0"})
    ing: tuple[str, dict[str, str]] = ("cortex_ingest_start_time_seconds", {})
    watched, other = (ext, ing) if child == "extproc" else (ing, ext)
    before = _value(gw, watched[0], **watched[1])
    other_before = _value(gw, other[0], **other[1])
    assert before is not None and other_before is not None
    (pid,) = gw.child_pids(f"cortexctl.cli {child}")
    os.kill(pid, signal.SIGKILL)
    after = wait_for(lambda: (v := _value(gw, watched[0], **watched[1])) is not None and v > before and v,
                     timeout=60, what=f"{child}'s new start time")
    assert after > before
    assert _value(gw, other[0], **other[1]) == other_before
    wait_for(lambda: all(t["exact_kv"] for t in gw.targets().values()), timeout=60, what="exact-KV routing back")
