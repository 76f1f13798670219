"""The status page for a person, on ingest's port: `GET /cortex/ui` (HTML) and `GET /cortex/ui/data` (JSON).

The fleet is ingest's own `/cortex/workers` document (`Ingest.status`), reduced to what a person scans; the
last decisions and the hit ratio over time come from the observer's HTTP port (`cortex observe`:
`/cortex/decisions`, `/cortex/hit-ratio`), asked with a short timeout. When the observer does not answer the
page says "observation unavailable" and still shows the fleet: one missing part never hides the rest.

The HTML is rendered here, with no script and no external asset (it works offline; its Content-Security-Policy
forbids anything else); a meta refresh reloads it. Every value is escaped where it is written (worker ids and
reasons come from the config and the engines). Prompts are never shown: only the decision fields named in
`DECISION_FIELDS` are kept from the observer's answer, whatever else it sends.
"""

from __future__ import annotations

import asyncio
import html
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from cortex import admin_auth
from cortex.config import ObserveConfig, reachable_host
from cortex.errors import error_body

if TYPE_CHECKING:
    from ingest.service import Ingest

OBSERVER_TIMEOUT_S = 0.5
"""The page must come back at once even when the observer hangs; a slower answer counts as none."""
DECISIONS_SHOWN = 50
HIT_RATIO_WINDOW_S = 600
REFRESH_S = 5
MAX_TEXT = 200
"""Longest string shown from the observer (a reason or a cause); longer ones are cut."""

DECISION_FIELDS: dict[str, type] = {
    "request_id": str, "time": float, "model": str, "worker": str, "mode": str, "reason": str,
    "claimed_hit_tokens": int, "engine_cached_tokens": int, "prompt_tokens": int, "completion_tokens": int,
    "ttft_ms": float, "e2e_ms": float, "status": int, "cause": str,
}
POINT_FIELDS = ("engine_cached_tokens", "prompt_tokens", "claimed_hit_tokens")


# ---- the data (pure) ------------------------------------------------------------------------------------------

def fleet(status: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per routing target (a worker, or one data-parallel rank of it) from `Ingest.status()`."""
    rows = []
    for w in status.get("workers", []):
        for t in w.get("targets", []):
            load = t.get("load") or {}
            parity = t.get("parity") or {}
            rows.append({
                "worker": w["id"], "target": t["id"], "model": w.get("model"), "engine": w.get("engine"),
                "role": t.get("role", "both"),
                "health": "down" if not t.get("healthy", w.get("healthy")) else
                          "suspect" if t.get("suspect") else "healthy",
                "health_failures": w.get("health_failures", 0),
                "breaker": (w.get("breaker") or {}).get("state", "closed"),
                "state": t.get("state", ""),
                "subscription": (t.get("subscription") or {}).get("state", ""),
                "events": t.get("events", ""),
                "running": load.get("running"), "waiting": load.get("waiting"), "load_age_s": load.get("age_s"),
                "cached_blocks": t.get("cached_blocks"),
                "lower_tiers": _lower_tiers(t.get("kv_lanes") or {}),
                "layout": " + ".join(f"window {g['need']} blocks" if g.get("kind") == "window" else "full"
                                     for g in t.get("groups") or ()),
                "exact_kv": bool(t.get("exact_kv")), "why_not_exact": "" if t.get("exact_kv") else t.get("reason", ""),
                "hash_parity": parity.get("status", ""),
                "token_parity": (w.get("token_parity") or {}).get("status", ""),
                "last_event_age_s": t.get("last_event_age_s"), "gaps": t.get("gaps", 0),
            })
    return rows


def _lower_tiers(lanes: dict[str, Any]) -> dict[str, int]:
    """Blocks held per lower tier (offloaded copies), from the ledger's lanes (`<tier>/<group>/...`)."""
    out: dict[str, int] = {}
    for lane, n in lanes.items():
        tier = str(lane).split("/", 1)[0]
        if tier != "GPU" and isinstance(n, int):
            out[tier] = out.get(tier, 0) + n
    return out


def _coerce(value: Any, kind: type) -> Any:
    if value is None or isinstance(value, bool):
        return None
    if kind is str:
        return str(value)[:MAX_TEXT]
    if isinstance(value, int | float):
        return kind(value)
    return None


def claim_check(claimed: int | None, engine: int | None) -> str:
    """over (a claim above the engine's own figure: a correctness alarm), exact, under, or unreported."""
    if engine is None:
        return "unreported"
    claimed = claimed or 0
    return "over" if claimed > engine else "exact" if claimed == engine else "under"


def decisions(doc: Any) -> list[dict[str, Any]]:
    """The observer's `/cortex/decisions` answer, newest first, each entry cut to `DECISION_FIELDS` (so a field
    the observer adds, a prompt's token ids say, never reaches the page). Raises ValueError when malformed."""
    if not isinstance(doc, dict) or not isinstance(doc.get("decisions"), list):
        raise ValueError("malformed /cortex/decisions answer")
    out = []
    for d in doc["decisions"][:DECISIONS_SHOWN]:
        if not isinstance(d, dict):
            continue
        row = {name: _coerce(d.get(name), kind) for name, kind in DECISION_FIELDS.items()}
        row["check"] = claim_check(row["claimed_hit_tokens"], row["engine_cached_tokens"])
        out.append(row)
    return out


def _ratio(part: int, whole: int) -> float | None:
    return round(part / whole, 4) if whole > 0 else None


def hit_ratio(doc: Any) -> dict[str, Any]:
    """The observer's `/cortex/hit-ratio` answer, oldest first, with each bucket's ratio (engine-reported cached
    tokens over prompt tokens; None for a bucket without prompt tokens) and the window's totals."""
    if not isinstance(doc, dict) or not isinstance(doc.get("points"), list):
        raise ValueError("malformed /cortex/hit-ratio answer")
    step = doc.get("step_s")
    points = []
    for p in doc["points"]:
        if not isinstance(p, dict) or not isinstance(p.get("t"), int | float):
            continue
        counts = {f: int(v) if isinstance(v, int | float) and not isinstance(v, bool) else 0
                  for f in POINT_FIELDS for v in [p.get(f)]}
        points.append({"t": p["t"], **counts, "ratio": _ratio(counts["engine_cached_tokens"], counts["prompt_tokens"]),
                       "claimed_ratio": _ratio(counts["claimed_hit_tokens"], counts["prompt_tokens"])})
    totals = {f: sum(p[f] for p in points) for f in POINT_FIELDS}
    return {"step_s": step if isinstance(step, int | float) and not isinstance(step, bool) else None,
            "points": points, "totals": totals,
            "ratio": _ratio(totals["engine_cached_tokens"], totals["prompt_tokens"]),
            "claimed_ratio": _ratio(totals["claimed_hit_tokens"], totals["prompt_tokens"])}


def unavailable(reason: str) -> dict[str, Any]:
    return {"available": False, "error": reason, "decisions": [], "hit_ratio": None}


# ---- the HTML (pure) ------------------------------------------------------------------------------------------

def _e(value: Any) -> str:
    """Escaped text for HTML content and quoted attributes; None shows as a dash."""
    return "–" if value is None or value == "" else html.escape(str(value), quote=True)


def _num(v: Any) -> str:
    """A count as a person reads it: 3, not 3.0 (vLLM reports its queue lengths as float gauges)."""
    return _e(int(v) if isinstance(v, float) and v.is_integer() else v)


def _clock(t: Any) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(t)) if isinstance(t, int | float) else "–"


def _pct(r: float | None) -> str:
    return "–" if r is None else f"{100 * r:.1f} %"


# CSS classes come from these fixed tables, never from the data.
_HEALTH = {"healthy": "ok", "suspect": "warn", "down": "bad"}
_BREAKER = {"closed": "ok", "half_open": "warn", "open": "bad"}
_STATE = {"READY": "ok", "SYNCING": "warn", "CONNECTING": "warn", "STALE": "bad"}
_CHECK = {"exact": "ok", "under": "warn", "over": "bad", "unreported": "dim"}

_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:16px 24px;color:#1d2330;background:#f7f8fa}
h1{font-size:20px;margin:0 0 2px}h2{font-size:16px;margin:22px 0 6px}
.sub{color:#5b6475;font-size:12px}
table{border-collapse:collapse;background:#fff;font-size:13px}
th,td{border:1px solid #dde1e8;padding:3px 7px;text-align:left;vertical-align:top;white-space:nowrap}
th{background:#eef1f5;font-weight:600}td.num{text-align:right;font-variant-numeric:tabular-nums}
td.why{white-space:normal;max-width:340px}
.ok{color:#13794b}.warn{color:#a86400}.bad{color:#c0262d;font-weight:600}.dim{color:#8a91a0}
.note{background:#fff4e5;border:1px solid #f0c98a;padding:6px 10px;display:inline-block}
svg{background:#fff;border:1px solid #dde1e8}
"""


def _fleet_html(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return '<p class="dim">No workers.</p>'
    head = ("<tr><th>target</th><th>worker</th><th>model</th><th>engine</th><th>role</th><th>health</th>"
            "<th>ledger sync</th><th>KV events</th><th>running</th><th>waiting</th><th>cached blocks</th>"
            "<th>lower tiers</th><th>KV-cache groups</th>"
            "<th>exact-KV</th><th>hash parity</th><th>tokenizer parity</th></tr>")
    body = []
    for r in rows:
        exact = ('<span class="ok">yes</span>' if r["exact_kv"]
                 else f'<span class="warn">no</span>: {_e(r["why_not_exact"])}')
        cells = [
            ("target", _e(r["target"]), ""), ("worker", _e(r["worker"]), ""), ("model", _e(r["model"]), ""),
            ("engine", _e(r["engine"]), ""), ("role", _e(r["role"]), ""),
            ("health", _e(r["health"]), _HEALTH.get(r["health"], "")),
            ("breaker", _e(r["breaker"]), _BREAKER.get(r["breaker"], "")),
            ("state", _e(r["state"]), _STATE.get(r["state"], "")),
            ("subscription", _e(r["subscription"]), ""),
            ("running", _num(r["running"]), "num"), ("waiting", _num(r["waiting"]), "num"),
            ("cached_blocks", _num(r["cached_blocks"]), "num"),
            ("lower_tiers", _e(", ".join(f"{t} {n}" for t, n in r["lower_tiers"].items())), ""),
            ("layout", _e(r["layout"]), ""),
            ("exact_kv", exact, "why"),
            ("hash_parity", _e(r["hash_parity"]), "bad" if r["hash_parity"] == "failed" else ""),
            ("token_parity", _e(r["token_parity"]), "bad" if r["token_parity"] == "failed" else ""),
        ]
        tds = "".join(f'<td data-field="{name}" class="{cls}">{text}</td>' for name, text, cls in cells)
        body.append(f'<tr data-target="{_e(r["target"])}">{tds}</tr>')
    return f'<table id="fleet">{head}{"".join(body)}</table>'


def _decisions_html(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return '<p class="dim">No finished request observed yet.</p>'
    head = ("<tr><th>time (UTC)</th><th>request</th><th>model</th><th>worker</th><th>mode</th><th>reason</th>"
            "<th>claimed hit</th><th>engine cached</th><th>check</th><th>prompt</th><th>completion</th>"
            "<th>TTFT ms</th><th>e2e ms</th><th>status</th></tr>")
    body = []
    for d in rows:
        status = _e(d["status"]) + (f' <span class="bad">{_e(d["cause"])}</span>' if d["cause"] else "")
        ms = {k: None if d[k] is None else f"{d[k]:.0f}" for k in ("ttft_ms", "e2e_ms")}
        cells = [
            ("time", _clock(d["time"]), ""), ("request_id", _e(d["request_id"]), ""), ("model", _e(d["model"]), ""),
            ("worker", _e(d["worker"]), ""), ("mode", _e(d["mode"]), ""), ("reason", _e(d["reason"]), "why"),
            ("claimed_hit_tokens", _e(d["claimed_hit_tokens"]), "num"),
            ("engine_cached_tokens", _e(d["engine_cached_tokens"]), "num"),
            ("check", _e(d["check"]), _CHECK.get(d["check"], "")),
            ("prompt_tokens", _e(d["prompt_tokens"]), "num"), ("completion_tokens", _e(d["completion_tokens"]), "num"),
            ("ttft_ms", _e(ms["ttft_ms"]), "num"), ("e2e_ms", _e(ms["e2e_ms"]), "num"), ("status", status, ""),
        ]
        tds = "".join(f'<td data-field="{name}" class="{cls}">{text}</td>' for name, text, cls in cells)
        body.append(f'<tr data-request="{_e(d["request_id"])}">{tds}</tr>')
    return f'<table id="decisions">{head}{"".join(body)}</table>'


def hit_ratio_chart(points: list[dict[str, Any]], width: int = 600, height: int = 80) -> str:
    """Inline SVG, one slot per bucket (oldest left): a bar to the engine-reported hit ratio and a tick at the
    claimed one, 0..100 %. A bucket with requests but no hit keeps a thin baseline; a bucket without prompt
    tokens stays empty, so no traffic never reads as a zero hit ratio."""
    n = max(len(points), 1)
    slot = (width - 8) / n
    bar = max(slot * 0.7, 1.0)
    top, span = 4.0, height - 8.0
    base = top + span
    out = []
    for i, p in enumerate(points):
        r, c = p.get("ratio"), p.get("claimed_ratio")
        if r is None:
            continue
        x = 4 + i * slot + (slot - bar) / 2
        h = max(span * min(max(r, 0.0), 1.0), 1.0)
        out.append(f'<rect class="bucket" x="{x:.1f}" y="{base - h:.1f}" width="{bar:.1f}" height="{h:.1f}" '
                   f'fill="#3a9a6b"/>')
        if c is not None:
            y = base - span * min(max(c, 0.0), 1.0)
            out.append(f'<line class="claim" x1="{x - 1:.1f}" x2="{x + bar + 1:.1f}" y1="{y:.1f}" y2="{y:.1f}" '
                       f'stroke="#a86400" stroke-width="2"/>')
    grid = "".join(f'<line x1="0" x2="{width}" y1="{top + span * f:.1f}" y2="{top + span * f:.1f}" '
                   f'stroke="#eef1f5"/>' for f in (0.0, 0.5, 1.0))
    return (f'<svg id="hit-ratio-chart" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
            f'role="img" aria-label="hit ratio per bucket, 0 to 100 percent">{grid}{"".join(out)}</svg>')


def _hit_ratio_html(hr: dict[str, Any]) -> str:
    points = hr["points"]
    if not any(p["prompt_tokens"] for p in points):
        return f'<p class="dim">No finished request in the last {HIT_RATIO_WINDOW_S // 60} min.</p>'
    t = hr["totals"]
    step = f"{hr['step_s']:g} s" if hr["step_s"] else "?"
    return (f'<p id="hit-ratio-summary">Last {HIT_RATIO_WINDOW_S // 60} min: engine-reported hit '
            f'<b data-field="ratio">{_pct(hr["ratio"])}</b> ({_e(t["engine_cached_tokens"])} of '
            f'{_e(t["prompt_tokens"])} prompt tokens); claimed by Cortex <b data-field="claimed_ratio">'
            f'{_pct(hr["claimed_ratio"])}</b> ({_e(t["claimed_hit_tokens"])}).</p>'
            f'{hit_ratio_chart(points)}<div class="sub">one bar per {_e(step)} bucket from '
            f'{HIT_RATIO_WINDOW_S // 60} min ago (left) to now (right), 0–100 %; <span class="ok">bar: '
            f'engine-reported</span>, <span class="warn">tick: claimed by Cortex</span></div>')


def render(data: dict[str, Any], refresh_s: int = REFRESH_S) -> str:
    """The whole page from `/cortex/ui/data`'s document."""
    obs = data["observation"]
    if obs["available"]:
        observed = (f"<h2>Last decisions</h2>{_decisions_html(obs['decisions'])}"
                    f"<h2>Hit ratio over time</h2>{_hit_ratio_html(obs['hit_ratio'])}")
    else:
        observed = (f'<h2>Last decisions and hit ratio</h2><p class="note" id="observation-unavailable">'
                    f'observation unavailable: {_e(obs["error"])}</p>')
    refresh = f'<meta http-equiv="refresh" content="{refresh_s}">' if refresh_s > 0 else ""
    generated = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(data["generated_at"]))
    rows = data["fleet"]
    exact = sum(r["exact_kv"] for r in rows)
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8">{refresh}'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>Cortex status</title><style>{_CSS}</style></head><body>"
            f'<h1>Cortex status</h1><div class="sub">{generated}'
            f'{f" · refreshes every {refresh_s} s" if refresh_s > 0 else ""} · JSON: '
            f'<a href="/cortex/ui/data">/cortex/ui/data</a></div>'
            f'<h2>Fleet <span class="sub">{len(rows)} targets, {exact} on exact-KV routing</span></h2>'
            f"{_fleet_html(rows)}{observed}</body></html>")


# ---- the handlers -----------------------------------------------------------------------------------------------

CSP = ("default-src 'none'; style-src 'unsafe-inline'; img-src 'none'; base-uri 'none'; form-action 'none'; "
       "frame-ancestors 'none'")
"""No script, no fetch, no external anything: the page is its own server-rendered HTML."""


def _error(status: int, message: str) -> web.Response:
    return web.Response(status=status, body=error_body(status, message), content_type="application/json")


class StatusPage:
    def __init__(self, ingest: Ingest, admin_token: str | None = None) -> None:
        self.ingest = ingest
        self.admin_token = admin_token
        """The observer's admin routes ask for it too (cortex/admin_auth.py)."""
        self._session: aiohttp.ClientSession | None = None

    async def close(self, _: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    async def _get(self, url: str) -> Any:
        if self._session is None:
            token = self.admin_token
            self._session = aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"} if token else None)
        async with self._session.get(url, timeout=aiohttp.ClientTimeout(total=OBSERVER_TIMEOUT_S)) as r:
            if r.status != 200:
                raise ValueError(f"{url.split('?')[0]} answered {r.status}")
            return await r.json(content_type=None)

    async def observation(self, cfg: ObserveConfig) -> dict[str, Any]:
        host = reachable_host(cfg.host)
        base = f"http://{f'[{host}]' if ':' in host else host}:{cfg.http_port}"
        try:
            doc_d, doc_h = await asyncio.gather(
                self._get(f"{base}/cortex/decisions?limit={DECISIONS_SHOWN}"),
                self._get(f"{base}/cortex/hit-ratio?window_s={HIT_RATIO_WINDOW_S}"))
            return {"available": True, "error": "", "decisions": decisions(doc_d), "hit_ratio": hit_ratio(doc_h)}
        except TimeoutError:
            return unavailable(f"the observer at {base} did not answer within {OBSERVER_TIMEOUT_S} s")
        except (aiohttp.ClientError, OSError) as exc:
            return unavailable(f"the observer at {base} is not reachable ({type(exc).__name__})")
        except ValueError as exc:  # bad JSON or a malformed document
            return unavailable(f"the observer at {base} answered badly: {exc}")

    async def data(self) -> dict[str, Any]:
        # The fleet first, from ingest's own state at this instant; the observer's wait cannot change it.
        rows = fleet(self.ingest.status())
        return {"generated_at": time.time(), "fleet": rows,
                "observation": await self.observation(self.ingest.cfg.observe)}

    async def page(self, request: web.Request) -> web.Response:
        raw = request.query.get("refresh", str(REFRESH_S))
        if not raw.isdigit() or int(raw) > 3600:
            return _error(400, "refresh: seconds between reloads, 0 (off) to 3600")
        body = render(await self.data(), int(raw))
        return web.Response(text=body, content_type="text/html", charset="utf-8", headers={
            "Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Cache-Control": "no-store"})

    async def data_json(self, _: web.Request) -> web.Response:
        return web.json_response(await self.data(), headers={"Cache-Control": "no-store"})


def add_routes(app: web.Application, ingest: Ingest) -> None:
    """`/cortex/ui` and `/cortex/ui/data` on ingest's app (its admin port only)."""
    page = StatusPage(ingest, admin_auth.admin_token(ingest.cfg))
    app.on_cleanup.append(page.close)
    handlers: dict[str, Callable[[web.Request], Awaitable[web.StreamResponse]]] = {
        "/cortex/ui": page.page, "/cortex/ui/data": page.data_json}
    for path, handler in handlers.items():
        app.router.add_get(path, handler)
