"""The status page (`/cortex/ui` on ingest's admin port, ingest/status_page.py), read in a real headless Chromium.

* A real gateway (simulated vLLM workers, Envoy, ingest, extproc) serves a few requests; Chromium loads the
  page and what it shows (targets, health, ledger sync state, load, cached blocks, exact-KV) equals
  `/cortex/workers`, read before and after the load (the comparison waits, with a deadline, for a moment when
  the two reads agree, so a late KV event cannot make it flaky). The decisions it shows are the observer's,
  newest first, with each request's worker, claimed hit and the engine's cached tokens. The screenshot goes to
  docs/img/status-page.png.
* The observer not answering (accepting connections and never replying): the page still shows the fleet and
  says "observation unavailable".
* Pure parts with vectors: every value escaped, no field outside the decision contract (no prompt) shown,
  claim checks, hit-ratio buckets, the chart's empty buckets, the observer refused or silent.

The decisions come from the real observer (`cortex observe`, docs/observability.md) the gateway runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import httpx
import pytest

from cortex.config import ObserveConfig
from ingest import status_page as sp
from tests.harness import Gateway, demo, free_ports, long_chat, wait_for
from tests.test_gateway import chat

ROOT = Path(__file__).resolve().parents[1]
SCREENSHOT = ROOT / "docs" / "img" / "status-page.png"


# ---- Chromium ---------------------------------------------------------------------------------------------------

def _chromium_binary() -> str:
    found = shutil.which("chromium")
    if found is None:
        # CI installs it (scripts/setup.sh); a developer without it is told how, not failed.
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed (scripts/setup.sh installs Debian's package)")
        pytest.skip("chromium is not installed: apt-get install --no-install-recommends chromium")
    return found


def chromium(*args: str) -> str:
    """Run headless Chromium once with a fresh temporary profile; its stdout."""
    with tempfile.TemporaryDirectory(prefix="cortex-chromium-") as profile:
        cmd = [_chromium_binary(), "--headless", f"--user-data-dir={profile}", "--no-first-run",
               "--disable-gpu", "--disable-extensions", "--disable-background-networking", "--hide-scrollbars"]
        if os.geteuid() == 0:
            # Chromium refuses to start as root with its sandbox on; CI (and this machine) run as root.
            cmd.append("--no-sandbox")
        out = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout


class Page(HTMLParser):
    """What the browser's DOM holds: the fleet rows by target, the decision rows in order, each cell's text by
    its data-field, the ids present and all the text."""

    def __init__(self, dom: str) -> None:
        super().__init__()
        self.fleet: dict[str, dict[str, str]] = {}
        self.decisions: list[dict[str, str]] = []
        self.ids: set[str] = set()
        self.text = ""
        self._row: dict[str, str] | None = None
        self._field: str | None = None
        self.feed(dom)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"] or "")
        if tag == "tr" and a.get("data-target") is not None:
            self._row = self.fleet.setdefault(a["data-target"] or "", {})
        elif tag == "tr" and a.get("data-request") is not None:
            self._row = {}
            self.decisions.append(self._row)
        elif tag == "td" and self._row is not None:
            self._field = a.get("data-field")
            if self._field:
                self._row[self._field] = ""

    def handle_endtag(self, tag: str) -> None:
        if tag == "td":
            self._field = None
        elif tag == "tr":
            self._row = None

    def handle_data(self, data: str) -> None:
        self.text += data
        if self._row is not None and self._field:
            self._row[self._field] += data


def load_page(gw: Gateway) -> Page:
    # refresh=0: the DOM dumped is the one page load, not a reload racing it.
    return Page(chromium("--dump-dom", f"{gw.ingest_url}/cortex/ui?refresh=0"))


# ---- what /cortex/workers says the page must show ---------------------------------------------------------------

def num(v: float | int | None) -> str:
    """A count as the page writes it (3, not 3.0; a dash when unknown)."""
    return "–" if v is None else str(int(v) if float(v).is_integer() else v)


def expected_fleet(gw: Gateway) -> dict[str, dict[str, str]]:
    out = {}
    for w in gw.workers().values():
        for t in w["targets"]:
            out[t["id"]] = {
                "worker": w["id"], "model": w["model"], "engine": w["engine"], "state": t["state"],
                "health": "down" if not t["healthy"] else "suspect" if t["suspect"] else "healthy",
                "running": num(t["load"]["running"]), "waiting": num(t["load"]["waiting"]),
                "cached_blocks": num(t["cached_blocks"]), "hash_parity": t["parity"]["status"],
                "token_parity": w["token_parity"]["status"], "subscription": t["subscription"]["state"],
                "exact_kv": "yes" if t["exact_kv"] else f"no: {t['reason']}",
            }
    return out


def page_matching_workers(gw: Gateway) -> Page:
    """The page as Chromium shows it, once it equals /cortex/workers read just before and just after it."""
    seen: dict[str, Any] = {}

    def agree() -> Page | None:
        before = expected_fleet(gw)
        page = load_page(gw)
        after = expected_fleet(gw)
        shown = {tid: {k: row.get(k, "") for k in next(iter(before.values()))} for tid, row in page.fleet.items()}
        seen.update(before=before, shown=shown)
        return page if before == after == shown else None

    try:
        return wait_for(agree, timeout=60, interval=0.5, what="the page to show /cortex/workers")
    except TimeoutError:
        raise AssertionError(f"page {seen.get('shown')} != /cortex/workers {seen.get('before')}") from None


# ---- the observer -----------------------------------------------------------------------------------------------

def observer_decisions(port: int) -> list[dict[str, Any]]:
    return httpx.get(f"http://127.0.0.1:{port}/cortex/decisions?limit={sp.DECISIONS_SHOWN}", timeout=5).json()[
        "decisions"]


@contextlib.contextmanager
def observer_silent(gw: Gateway) -> Iterator[None]:
    """The observer accepts connections and never answers: stopped (SIGSTOP, so the supervisor does not restart
    it)."""
    pids = gw.child_pids("cli observe")
    assert pids, "the gateway runs no observer"
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


# ---- end to end ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, int]]:
    with demo(tmp_path_factory.mktemp("status_page")) as g:  # the page as a demo user first sees it
        yield g, g.observe_http_port


@pytest.mark.timeout(300)
def test_page_shows_the_fleet_and_the_decisions(gw: tuple[Gateway, int]) -> None:
    g, http = gw
    _chromium_binary()
    # Two prompts, each sent twice (JSON, then SSE): the second of each is a proven hit on its worker.
    sent = []
    for seed in (1, 2):
        for stream in (False, True):
            headers, usage = chat(g, long_chat(400, seed=seed), stream=stream)
            sent.append((headers, usage))
    assert any(int(h["x-cortex-cache-hit-tokens"]) > 0 for h, _ in sent)

    # The observer's newest decisions are these requests, newest first.
    def observed() -> list[dict[str, Any]] | None:
        ds = observer_decisions(http)
        return ds if len(ds) >= len(sent) else None

    wait_for(observed, timeout=30, what="the observer to record the requests")
    page = page_matching_workers(g)
    assert set(page.fleet) == {s.id for s in g.sims}
    assert all(row["state"] == "READY" and row["exact_kv"] == "yes" for row in page.fleet.values())
    assert sum(int(row["cached_blocks"]) for row in page.fleet.values()) > 0

    ds = observer_decisions(http)
    shown = page.decisions
    assert [d["request_id"] for d in shown] == [d["request_id"] for d in ds]
    for (headers, usage), row in zip(reversed(sent), shown, strict=False):
        assert row["worker"] == headers["x-cortex-assigned-worker"]
        assert row["claimed_hit_tokens"] == headers["x-cortex-cache-hit-tokens"]
        assert row["engine_cached_tokens"] == str(usage["prompt_tokens_details"]["cached_tokens"])
        assert row["prompt_tokens"] == str(usage["prompt_tokens"])
        assert row["check"] == sp.claim_check(int(row["claimed_hit_tokens"]), int(row["engine_cached_tokens"]))
    assert "hit-ratio-chart" in page.ids and "observation-unavailable" not in page.ids
    for seed in (1, 2):  # the page shows what was decided, never what was asked
        assert all(m["content"][:40] not in page.text for m in long_chat(400, seed=seed))

    data = httpx.get(f"{g.ingest_url}/cortex/ui/data", timeout=5).json()
    assert data["observation"]["available"] is True
    assert {r["target"] for r in data["fleet"]} == set(page.fleet)
    assert all("prompt" not in d for d in data["observation"]["decisions"])

    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    chromium(f"--screenshot={SCREENSHOT}", "--window-size=1440,760", f"{g.ingest_url}/cortex/ui?refresh=0")
    assert SCREENSHOT.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(300)
def test_page_without_the_observer_still_shows_the_fleet(gw: tuple[Gateway, int]) -> None:
    g, _ = gw
    _chromium_binary()
    with observer_silent(g):
        page = page_matching_workers(g)
        assert set(page.fleet) == {s.id for s in g.sims}
        assert "observation-unavailable" in page.ids
        assert "observation unavailable" in page.text and "did not answer" in page.text
        assert page.decisions == []

        r = httpx.get(f"{g.ingest_url}/cortex/ui", timeout=10)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert "script-src" not in r.headers["content-security-policy"]  # default-src 'none': no script at all
        data = httpx.get(f"{g.ingest_url}/cortex/ui/data", timeout=10).json()
        assert data["observation"]["available"] is False
        assert {r["target"] for r in data["fleet"]} == set(page.fleet)

    bad = httpx.get(f"{g.ingest_url}/cortex/ui?refresh=soon", timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["message"].startswith("refresh:")


# ---- pure parts ---------------------------------------------------------------------------------------------------

HOSTILE = '<script>alert(1)</script>"\'&'


def status_doc(**target: Any) -> dict[str, Any]:
    t = {"id": "gpu-0", "worker": "gpu-0", "healthy": True, "suspect": False, "exact_kv": True, "state": "READY",
         "reason": "", "role": "both", "load": {"running": 2, "waiting": 1, "age_s": 0.1}, "events": "flowing",
         "parity": {"status": "ok"}, "cached_blocks": 42, "gaps": 0, "subscription": {"state": "live"}, **target}
    return {"workers": [{"id": t["worker"], "model": "m", "engine": "vllm", "healthy": t["healthy"],
                         "health_failures": 0, "token_parity": {"status": "ok"}, "targets": [t]}]}


def decision(**kw: Any) -> dict[str, Any]:
    return {"request_id": "r1", "time": 1_700_000_000.0, "model": "m", "worker": "gpu-0", "mode": "exact_kv_events",
            "reason": "longest_prefix", "claimed_hit_tokens": 32, "engine_cached_tokens": 32, "prompt_tokens": 100,
            "completion_tokens": 8, "ttft_ms": 12.5, "e2e_ms": 80.0, "status": 200, "cause": "", **kw}


def page_data(rows: list[dict[str, Any]], obs: dict[str, Any]) -> dict[str, Any]:
    return {"generated_at": 1_700_000_000.0, "fleet": rows, "observation": obs}


def test_fleet_rows_from_the_workers_document() -> None:
    (row,) = sp.fleet(status_doc())
    want = {"target": "gpu-0", "worker": "gpu-0", "health": "healthy", "state": "READY", "running": 2, "waiting": 1,
            "cached_blocks": 42, "exact_kv": True, "why_not_exact": "", "hash_parity": "ok", "token_parity": "ok",
            "subscription": "live"}
    assert {k: row[k] for k in want} == want
    (down,) = sp.fleet(status_doc(healthy=False, exact_kv=False, reason="worker down"))
    assert down["health"] == "down" and down["why_not_exact"] == "worker down"
    (suspect,) = sp.fleet(status_doc(suspect=True))
    assert suspect["health"] == "suspect"
    assert row["breaker"] == "closed"  # a document without breakers (an older ingest): closed


def test_the_fleet_table_marks_a_worker_whose_breaker_is_open() -> None:
    doc = status_doc()
    doc["workers"][0]["breaker"] = {"state": "open", "processes": {"0": "open"}}
    rows = sp.fleet(doc)
    assert rows[0]["breaker"] == "open"
    html = sp.render(page_data(rows, sp.unavailable("down")))
    assert 'data-field="breaker" class="bad">open<' in html


def test_everything_rendered_is_escaped() -> None:
    rows = sp.fleet(status_doc(id=HOSTILE, worker=HOSTILE, exact_kv=False, reason=HOSTILE, state=HOSTILE))
    obs = {"available": True, "error": "", "decisions": sp.decisions({"decisions": [
        decision(request_id=HOSTILE, worker=HOSTILE, reason=HOSTILE, mode=HOSTILE, cause=HOSTILE, model=HOSTILE)]}),
        "hit_ratio": sp.hit_ratio({"step_s": 10, "points": []})}
    out = sp.render(page_data(rows, obs))
    assert "<script>" not in out and "alert(1)</script>" not in out
    assert out.count("&lt;script&gt;alert(1)&lt;/script&gt;&quot;&#x27;&amp;") >= 8
    down = sp.render(page_data(rows, sp.unavailable(HOSTILE)))
    assert "<script>" not in down and "observation unavailable: &lt;script&gt;" in down


def test_decisions_keep_only_the_contract_fields() -> None:
    secret = decision(prompt="the user's secret", prompt_token_ids=[1, 2, 3], messages=[{"content": "x"}])
    (d,) = sp.decisions({"decisions": [secret, "not a decision"]})
    assert set(d) == {*sp.DECISION_FIELDS, "check"}
    out = sp.render(page_data([], {"available": True, "error": "", "decisions": [d],
                                   "hit_ratio": sp.hit_ratio({"step_s": 10, "points": []})}))
    assert "secret" not in out and "prompt_token_ids" not in out
    (weird,) = sp.decisions({"decisions": [decision(claimed_hit_tokens="lots", status=True, reason="x" * 500)]})
    assert weird["claimed_hit_tokens"] is None and weird["status"] is None and len(weird["reason"]) == sp.MAX_TEXT
    bad: object
    for bad in (None, [], {"decisions": {}}, {"points": []}):
        with pytest.raises(ValueError):
            sp.decisions(bad)


@pytest.mark.parametrize(("claimed", "engine", "check"), [
    (32, 32, "exact"), (48, 32, "over"), (16, 32, "under"), (0, 0, "exact"), (None, 16, "under"),
    (32, None, "unreported"), (0, None, "unreported")])
def test_claim_check(claimed: int | None, engine: int | None, check: str) -> None:
    assert sp.claim_check(claimed, engine) == check


def test_hit_ratio_buckets_and_totals() -> None:
    hr = sp.hit_ratio({"step_s": 10, "points": [
        {"t": 0, "engine_cached_tokens": 50, "prompt_tokens": 100, "claimed_hit_tokens": 40},
        {"t": 10, "engine_cached_tokens": 0, "prompt_tokens": 0, "claimed_hit_tokens": 0},
        {"t": 20, "engine_cached_tokens": 30, "prompt_tokens": 100, "claimed_hit_tokens": 32},
        {"t": "bad"}, "junk"]})
    assert [p["ratio"] for p in hr["points"]] == [0.5, None, 0.3]
    assert [p["claimed_ratio"] for p in hr["points"]] == [0.4, None, 0.32]
    assert hr["totals"] == {"engine_cached_tokens": 80, "prompt_tokens": 200, "claimed_hit_tokens": 72}
    assert hr["ratio"] == 0.4 and hr["claimed_ratio"] == 0.36 and hr["step_s"] == 10
    with pytest.raises(ValueError):
        sp.hit_ratio({"step_s": 10})
    out = sp.render(page_data([], {"available": True, "error": "", "decisions": [], "hit_ratio": hr}))
    assert "40.0 %" in out and "36.0 %" in out and "hit-ratio-chart" in out
    empty = sp.render(page_data([], {"available": True, "error": "", "decisions": [],
                                     "hit_ratio": sp.hit_ratio({"step_s": 10, "points": []})}))
    assert "hit-ratio-chart" not in empty and "No finished request" in empty


def test_chart_leaves_empty_buckets_empty() -> None:
    pts: list[dict[str, Any]] = [{"ratio": 0.5, "claimed_ratio": 0.25}, {"ratio": 1.0, "claimed_ratio": 1.0},
                                 {"ratio": None, "claimed_ratio": None}, {"ratio": 0.0, "claimed_ratio": 0.0}]
    svg = sp.hit_ratio_chart(pts, width=108, height=108)
    # Slots of 25 px, bars of 17.5: a bucket without traffic draws nothing; a zero hit keeps a 1 px baseline.
    assert svg.count('class="bucket"') == 3 and svg.count('class="claim"') == 3
    assert '<rect class="bucket" x="7.8" y="54.0" width="17.5" height="50.0"' in svg
    assert '<rect class="bucket" x="32.8" y="4.0" width="17.5" height="100.0"' in svg
    assert '<rect class="bucket" x="82.8" y="103.0" width="17.5" height="1.0"' in svg
    assert 'x1="6.8" x2="26.2" y1="79.0" y2="79.0"' in svg  # the claim (25 %) under the engine's 50 %


def test_observer_refused_or_silent_is_unavailable() -> None:
    (port,) = free_ports(1)

    async def ask() -> dict[str, Any]:
        page = sp.StatusPage(None)  # type: ignore[arg-type]  # observation() reads only its config
        try:
            return await page.observation(ObserveConfig(http_port=port))
        finally:
            await page.close(None)  # type: ignore[arg-type]

    refused = asyncio.run(ask())
    assert refused["available"] is False and "not reachable" in refused["error"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen(8)
        silent = asyncio.run(ask())
    assert silent["available"] is False and "did not answer" in silent["error"]
