"""Turn a benchmark's figures (the dict `runner.run` returns) into Markdown tables, goal checks and PNG plots.

`write_markdown` replaces what lies between the two result markers of a document (docs/benchmarks.md), so the
hand-written reading around the tables stays put when the numbers are regenerated.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

START, END = "<!-- bench:results:start -->", "<!-- bench:results:end -->"
LATE_SEND_MS = 100.0
"""A table notes a contestant's run whose first requests left the client more than this late (p99) after their
arrival times: the client, not the contestant, set part of that run's pace."""


def num(v: Any, digits: int = 1) -> str:
    """A figure for a table: floats to `digits`, a missing one as a dash."""
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


_f = num


def run_line(out: dict[str, Any]) -> str:
    """When and where a run ran, and how long it took: the opening of every mode's report."""
    m = out["machine"]
    end = f", at the end {m['loadavg_at_end']}" if m.get("loadavg_at_end") else ""
    return (f"Run {out['started']} on {m['cpus']} × {m['cpu_model'] or 'CPU'} ({m['platform']}, Python "
            f"{m['python']}; load average at start {m['loadavg_at_start']}{end}), {num(out.get('elapsed_s'))} s "
            f"in all. ")


def _ok(r: dict[str, Any]) -> bool:
    return "unavailable" not in r and "failed" not in r


def _pm(r: dict[str, Any], key: str, digits: int = 1) -> str:
    """A figure, with ± its spread over seeds when there was more than one seed."""
    value: Any = r
    for k in key.split("."):
        value = value.get(k) if isinstance(value, dict) else None
    spread = (r.get("spread") or {}).get(key) if "seeds" in r else None
    return _f(value, digits) + (f" ± {_f(spread, digits)}" if spread else "")


def _fleet_note(block: dict[str, Any]) -> str:
    f = block.get("fleet")
    if not f:
        return ""
    return (f"; fleet {f['workers']} workers × {f['kv_tokens_per_worker']} KV tokens, working set ~"
            f"{f['working_set_tokens']} tokens = {_f(f['kv_fill'], 2)} × the fleet's KV"
            + (" (the largest seed's)" if len(block["params"].get("seeds") or []) > 1 else ""))


def workload_table(name: str, block: dict[str, Any]) -> str:
    results = block["results"]
    oracle = results.get("oracle", {}).get("hit_ratio") if _ok(results.get("oracle", {})) else None
    lines = ["| contestant | hit ratio | × oracle | TTFT p50 | TTFT p90 | TTFT p99 | ITL p50 | ITL p90 | e2e p50 | "
             "e2e p90 | req/s | errors | imbalance | gateway CPU ms/req |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for cname, r in results.items():
        if "unavailable" in r:
            lines.append(f"| {cname} | not available: {r['unavailable']} |" + " |" * 12)
            continue
        if "failed" in r:
            lines.append(f"| {cname} | failed: {r['failed'][:120]} |" + " |" * 12)
            continue
        rel = r["hit_ratio"] / oracle if oracle and r["hit_ratio"] is not None else None
        lines.append(f"| {cname} | {_pm(r, 'hit_ratio', 3)} | {_f(rel, 2)} | {_pm(r, 'ttft_ms.p50')} | "
                     f"{_pm(r, 'ttft_ms.p90')} | {_pm(r, 'ttft_ms.p99')} | {_pm(r, 'itl_ms.p50')} | "
                     f"{_pm(r, 'itl_ms.p90')} | {_f(r['e2e_ms']['p50'])} | "
                     f"{_f(r['e2e_ms']['p90'])} | {_f(r['rps'], 2)} | {r['errors']}/{r['requests']} | "
                     f"{_f(r['imbalance'], 2)} | {_pm(r, 'gateway_cpu_ms_per_request')} |")
        if r.get("bypass_requests"):
            notes.append(f"{cname}: {r['bypass_requests']} requests bypassed the gateway, their hit ratio "
                         f"{_f(r.get('bypass_hit_ratio'), 3)}")
        for seed_run in (r.get("seeds") or {"": r}).values():
            for d in seed_run.get("disruptions") or []:
                if d["ok"] is None:
                    notes.append(f"{cname}: {d['kind']} at {d['at_s']:g} s not reached (the run ended first)")
                else:
                    notes.append(f"{cname}: {d['kind']} of {d['worker']} at {d['at_s']:g} s "
                                 f"{'done' if d['ok'] else 'REFUSED'} in {d['took_s']} s")
        if r.get("failed_seeds"):
            notes.append(f"{cname}: seeds {', '.join(r['failed_seeds'])} failed; the figures are the others'")
        late = [(seed, run["send_lag_ms"]) for seed, run in (r.get("seeds") or {"": r}).items()
                if (run.get("send_lag_ms") or {}).get("p99", 0) > LATE_SEND_MS]
        for seed, lag in late:
            notes.append(f"{cname}: the client sent behind schedule{f' (seed {seed})' if seed else ''}: first "
                         f"requests' send lag p99 {_f(lag['p99'])} ms, max {_f(lag['max'])} ms (the replay ran "
                         f"slower than the workload's rate)")
    params = ", ".join(f"{k}={v}" for k, v in block["params"].items())
    seeds = block["params"].get("seeds") or []
    spread = "; ± is half the range over the seeds" if len(seeds) > 1 else ""
    tail = "".join(f"\n- {n}" for n in notes)
    return (f"**{name}** ({params}){_fleet_note(block)}; times in ms{spread}\n\n" + "\n".join(lines) + "\n"
            + (tail + "\n" if tail else ""))


def overhead_table(overhead: dict[str, Any]) -> str:
    lines = ["| contestant | prompt | overhead p50 (ms) | overhead p90 (ms) | TTFT via gateway p50 | TTFT direct p50 | "
             "pairs |", "|---|---|---|---|---|---|---|"]
    for cname, sizes in overhead.items():
        for size, o in sizes.items():
            lines.append(f"| {cname} | {size}, ~{o['prompt_words']} tokens | {_f(o['p50_ms'])} | {_f(o['p90_ms'])} | "
                         f"{_f(o['via_p50_ms'])} | {_f(o['direct_p50_ms'])} | {o['pairs']} |")
    return "\n".join(lines) + "\n"


def sweep_table(sweep: dict[str, Any]) -> str:
    rates = sweep["rates"]
    head = "| contestant | " + " | ".join(f"{r:g}/s: TTFT p50 / p90, hit" for r in rates) + " |"
    lines = [head, "|---|" + "---|" * len(rates)]
    for cname, rows in sweep["results"].items():
        cells = []
        for row in rows:
            if not _ok(row):
                cells.append("n/a")
            else:
                cells.append(f"{_f(row['ttft_ms']['p50'])} / {_f(row['ttft_ms']['p90'])}, {_f(row['hit_ratio'], 3)}")
        lines.append(f"| {cname} | " + " | ".join(cells) + " |")
    return f"**{sweep['workload']}**, request rate swept; times in ms\n\n" + "\n".join(lines) + "\n"


def goals(out: dict[str, Any]) -> list[tuple[str, str, bool | str | None]]:
    """(goal, measured, met) for the goals issue 6 sets; met is None when a figure is missing."""
    rows: list[tuple[str, str, bool | str | None]] = []
    res = out["workloads"].get("shared-prefix", {}).get("results", {})

    def hit(name: str, r: dict[str, Any]) -> float | None:
        v = r.get(name, {})
        return v.get("hit_ratio") if _ok(v) else None

    cx, orc, sg = hit("cortex", res), hit("oracle", res), hit("sglang-cache-aware", res)
    if res:
        rows.append(("shared-prefix: Cortex hit ratio ≥ 0.95 × oracle",
                     f"{_f(cx, 3)} vs {_f(orc, 3)} ({_f(cx / orc if cx is not None and orc else None, 3)}×)",
                     None if cx is None or not orc else cx >= 0.95 * orc))
        rows.append(("shared-prefix: Cortex hit ratio ≥ 1.3 × sglang-router cache_aware",
                     f"{_f(cx, 3)} vs {_f(sg, 3)} ({_f(cx / sg if cx is not None and sg else None, 3)}×)",
                     None if cx is None or not sg else cx >= 1.3 * sg))
    res = out["workloads"].get("unique", {}).get("results", {})
    if res:
        c, rr = res.get("cortex", {}), res.get("round-robin", {})
        a = c.get("ttft_ms", {}).get("p50") if _ok(c) else None
        b = rr.get("ttft_ms", {}).get("p50") if _ok(rr) else None
        rel = a / b - 1 if a is not None and b else None
        rows.append(("unique: Cortex TTFT p50 within 5 % of round-robin",
                     f"{_f(a)} ms vs {_f(b)} ms ({_f(rel * 100 if rel is not None else None)} %)",
                     None if rel is None else rel <= 0.05))
    o = out.get("overhead", {})
    if "cortex" in o:
        sg_o = o.get("sglang-cache-aware") or o.get("sglang-round-robin")
        measured = "; ".join(f"{size}: Cortex p50 {_f(v['p50_ms'])} ms vs sglang-router "
                             f"{_f(sg_o[size]['p50_ms'] if sg_o else None)} ms" for size, v in o["cortex"].items())
        rows.append(("gateway overhead reported beside sglang-router's", measured, None if sg_o is None else True))
    return rows


def _cell(out: dict[str, Any], workload: str, replicas: int, *, bypass: float = 0.0,
          disrupted: bool = False) -> dict[str, Any]:
    """The results of the table for this workload and replica count (no stickiness), or {}."""
    for block in out["workloads"].values():
        if (block.get("workload") == workload and block.get("replicas", 1) == replicas
                and not block.get("sticky") and abs(block.get("bypass", 0.0) - bypass) < 1e-9
                and bool(block.get("disruptions")) == disrupted):
            return block["results"]
    return {}


def _fig(results: dict[str, Any], name: str, key: str) -> tuple[float | None, float]:
    r = results.get(name, {})
    if not _ok(r):
        return None, 0.0
    value: Any = r
    for k in key.split("."):
        value = value.get(k) if isinstance(value, dict) else None
    return value, float((r.get("spread") or {}).get(key) or 0.0)


def verdict(a: tuple[float | None, float], b: tuple[float | None, float], factor: float, higher: bool
            ) -> bool | str | None:
    """Is a >= factor x b (higher) or a <= factor x b (lower)? True when it holds even with both figures moved
    against it by their spreads over seeds; "within spread" when it holds for the means only; None when a
    figure is missing."""
    (x, sx), (y, sy) = a, b
    if x is None or y is None:
        return None
    if higher:
        return True if x - sx >= factor * (y + sy) else ("within spread" if x >= factor * y else False)
    return True if x + sx <= factor * (y - sy) else ("within spread" if x <= factor * y else False)


SMG = ("smg-cache-aware", "smg-cache-aware-mesh")
PEERS = ("smg-", "sglang-", "vllm-router-")
"""The peer gateways a cell's best is taken from (by name prefix): other projects' routers, not round-robin, the
oracle, or Cortex under another rule (`cortex-cache-aware`)."""


def fleet_goals(out: dict[str, Any]) -> list[tuple[str, str, bool | str | None]]:
    """The goals of the fleet benchmark (issue 12), for the cells this run has."""
    rows: list[tuple[str, str, bool | str | None]] = []

    def add(goal: str, results: dict[str, Any], key: str, other: str, factor: float, higher: bool) -> None:
        a, b = _fig(results, "cortex", key), _fig(results, other, key)
        if b[0] is None:
            return
        ratio = a[0] / b[0] if a[0] is not None and b[0] else None
        digits, unit = (3, "") if key == "hit_ratio" else (1, " ms")
        rows.append((goal, f"{_f(a[0], digits)}{unit} vs {_f(b[0], digits)}{unit} ({_f(ratio, 2)}×)",
                     verdict(a, b, factor, higher)))

    for workload in ("shared-prefix", "multi-turn", "agentic"):
        res = _cell(out, workload, 4)
        if not res:
            continue
        add(f"4 replicas, {workload}: hit ≥ 0.95 × oracle", res, "hit_ratio", "oracle", 0.95, True)
        for smg in SMG:
            add(f"4 replicas, {workload}: hit ≥ 1.3 × {smg}", res, "hit_ratio", smg, 1.3, True)
        add(f"4 replicas, {workload}: TTFT p50 ≤ smg-cache-aware's", res, "ttft_ms.p50", SMG[0], 1.0, False)
        add(f"4 replicas, {workload}: TTFT p90 ≤ 0.7 × smg-cache-aware's", res, "ttft_ms.p90", SMG[0], 0.7, False)
        add(f"4 replicas, {workload}: gateway CPU/req ≤ smg-cache-aware's", res, "gateway_cpu_ms_per_request",
            SMG[0], 1.0, False)
    for workload, disrupted in (("zipf-prefix", False), ("multi-turn", True), ("shared-prefix", True)):
        for replicas in (1, 2, 4):
            res = _cell(out, workload, replicas, disrupted=disrupted)
            if not res:
                continue
            what = f"{workload}{' with restarts' if disrupted else ''}, {replicas} replica(s)"
            add(f"{what}: hit ≥ 1.2 × smg-cache-aware", res, "hit_ratio", SMG[0], 1.2, True)
            add(f"{what}: TTFT p90 ≤ 0.8 × smg-cache-aware's", res, "ttft_ms.p90", SMG[0], 0.8, False)
    # A run saved before the blocks named their workload (docs/benchmarks.json) is keyed by it.
    for key, block in out["workloads"].items():
        if abs(block.get("bypass", 0.0) - 0.3) < 1e-9:
            add(f"{block.get('workload', key)}, bypass 30 %, {block.get('replicas', 1)} replica(s): hit ≥ 0.95 × "
                "oracle", block["results"], "hit_ratio", "oracle", 0.95, True)
    # Issue 24's ratios, against the best peer gateway of each cell (not round-robin, the oracle, or Cortex's own
    # other rules), with one gateway and with 4 replicas.
    for key, block in out["workloads"].items():
        replicas = block.get("replicas", 1)
        if replicas not in (1, 4) or block.get("bypass") or block.get("disruptions"):
            continue
        res = block["results"]
        peers = [n for n, r in res.items() if n.startswith(PEERS) and _ok(r) and r["hit_ratio"] is not None]
        if "cortex" not in res or not peers:
            continue
        where = f"{block.get('workload', key)}, {'one gateway' if replicas == 1 else '4 replicas'}"
        best = max(peers, key=lambda n: res[n]["hit_ratio"])
        add(f"{where}: hit ≥ 0.98 × the best peer ({best})", res, "hit_ratio", best, 0.98, True)
        for q in ("p50", "p90"):
            timed = [n for n in peers if res[n]["ttft_ms"].get(q) is not None]
            if timed:
                fastest = min(timed, key=lambda n: res[n]["ttft_ms"][q])
                add(f"{where}: TTFT {q} ≤ the best peer's ({fastest})", res, f"ttft_ms.{q}", fastest, 1.0, False)
    return rows


def goals_table(out: dict[str, Any]) -> str:
    # The single-gateway goals (issue 6) belong to the single-gateway report; a fleet run reports its own.
    fleet = any(b.get("replicas", 1) > 1 for b in out["workloads"].values())
    rows = [*([] if fleet else goals(out)), *fleet_goals(out)]
    if not rows:
        return ""
    mark = {True: "met", False: "**missed**", None: "n/a", "within spread": "met on the means, within the spread"}
    return "| goal | measured | |\n|---|---|---|\n" + "".join(f"| {g} | {m} | {mark[ok]} |\n" for g, m, ok in rows)


def cluster_line(out: dict[str, Any], blocks: list[dict[str, Any]]) -> str:
    """The fleet of the run's tables: the run's cluster, or, when the tables ran on fleets of their own (a
    workload designed for one), that fleet if they share it, or a pointer to each table's."""
    c = out["cluster"]
    fleets = {(b["fleet"]["workers"], b["fleet"]["kv_tokens_per_worker"]) for b in blocks if b.get("fleet")}
    if len(fleets) > 1:
        return f"Cluster: simulated {c['engine']} workers, the fleet each table states."
    workers, kv = fleets.pop() if fleets else (c["workers"], c["kv_tokens_per_worker"])
    return f"Cluster: {workers} simulated {c['engine']} workers, {kv} KV tokens each."


def markdown(out: dict[str, Any], command: str, images: list[Path] | None = None, rel_to: Path | None = None) -> str:
    parts = [f"Command: `{command}`\n", run_line(out) + cluster_line(out, list(out["workloads"].values())) + "\n"]
    for name, block in out["workloads"].items():
        parts.append(workload_table(name, block))
    if out.get("overhead"):
        parts.append("**Gateway overhead** (light load, one request at a time: TTFT through the contestant minus "
                     "TTFT straight to the worker it chose, cold prompts of equal length)\n\n"
                     + overhead_table(out["overhead"]))
    if out.get("sweep"):
        parts.append(sweep_table(out["sweep"]))
    g = goals_table(out)
    if g:
        parts.append("**Goals**\n\n" + g)
    for img in images or []:
        shown = img.relative_to(rel_to) if rel_to is not None else img
        parts.append(f"![{img.stem}]({shown})\n")
    return "\n".join(parts)


def markers(section: str = "results") -> tuple[str, str]:
    return f"<!-- bench:{section}:start -->", f"<!-- bench:{section}:end -->"


def write_markdown(path: Path, body: str, section: str = "results") -> None:
    """Put `body` between the `section` markers of `path` (appending the markers if the file lacks them)."""
    start, end = markers(section)
    text = path.read_text() if path.exists() else ""
    block = f"{start}\n{body}\n{end}"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = (text.rstrip() + "\n\n" if text else "") + block + "\n"
    path.write_text(text)


def plots(out: dict[str, Any], img_dir: Path) -> list[Path]:
    """Hit ratio and TTFT p90 per contestant per workload; TTFT vs request rate when swept. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    workloads = list(out["workloads"])
    names = list(out["contestants"])
    for key, label, fname in (("hit_ratio", "prefix-cache hit ratio", "bench-hit-ratio.png"),
                              ("ttft_p90", "TTFT p90 (ms)", "bench-ttft-p90.png")):
        fig, ax = plt.subplots(figsize=(max(10, 1.1 * len(workloads)), 4.2 if len(workloads) <= 4 else 5.5))
        width = 0.8 / max(len(names), 1)
        for i, cname in enumerate(names):
            values = []
            for w in workloads:
                r = out["workloads"][w]["results"].get(cname, {})
                v = None
                if r and _ok(r):
                    v = r["hit_ratio"] if key == "hit_ratio" else r["ttft_ms"]["p90"]
                values.append(v if v is not None else 0.0)
            ax.bar([j + i * width for j in range(len(workloads))], values, width, label=cname)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(workloads))], workloads,
                      rotation=25 if len(workloads) > 4 else 0, ha="right" if len(workloads) > 4 else "center",
                      fontsize=7 if len(workloads) > 4 else 10)
        ax.set_ylabel(label)
        ax.legend(fontsize=7, ncol=4)
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        path = img_dir / fname
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    written += _replica_plot(out, img_dir, plt)
    sweep = out.get("sweep")
    if sweep:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for cname, rows in sweep["results"].items():
            pts = [(row["rate"], row["ttft_ms"]["p90"]) for row in rows if _ok(row) and row["ttft_ms"]["p90"]]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=cname)
        ax.set_xlabel(f"request rate (req/s), {sweep['workload']}")
        ax.set_ylabel("TTFT p90 (ms)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = img_dir / "bench-ttft-vs-rate.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def _ceiling(block: dict[str, Any]) -> float | None:
    """The most any router can hit from empty caches: every distinct prompt token computed once."""
    ws, sent = block["params"].get("working_set_tokens"), block["params"].get("prompt_tokens")
    if isinstance(ws, list) and isinstance(sent, list):  # per seed (windows of a trace): over them all
        ws, sent = sum(ws), sum(sent)
    return 1.0 - ws / sent if ws and sent else None


def _replica_plot(out: dict[str, Any], img_dir: Path, plt: Any) -> list[Path]:
    """Share of the attainable hits and TTFT p90 against the number of gateway replicas, one panel per workload
    run at several (hit ratio over the workload's ceiling, so quick and full-size runs compare)."""
    series: dict[str, dict[str, dict[int, tuple[float | None, float | None]]]] = {}
    for block in out["workloads"].values():
        if block.get("bypass") or block.get("disruptions") or block.get("sticky"):
            continue
        ceiling = _ceiling(block)
        for cname, r in block["results"].items():
            if _ok(r) and r.get("hit_ratio") is not None:
                share = r["hit_ratio"] / ceiling if ceiling else r["hit_ratio"]
                by_n = series.setdefault(block.get("workload", "?"), {}).setdefault(cname, {})
                by_n[block.get("replicas", 1)] = (share, r["ttft_ms"]["p90"])
    shown = [w for w, by in series.items() if len({n for c in by.values() for n in c}) > 1]
    if not shown:
        return []
    colours = {name: f"C{i}" for i, name in enumerate(out["contestants"])}
    fig, axes = plt.subplots(2, len(shown), figsize=(3.6 * len(shown), 6.4), squeeze=False)
    for col, workload in enumerate(shown):
        for cname, by_n in series[workload].items():
            ns = sorted(by_n)
            for row in (0, 1):
                axes[row][col].plot(ns, [by_n[n][row] for n in ns], marker="o", label=cname, color=colours.get(cname))
        axes[0][col].set_title(workload)
        axes[0][col].set_ylabel("hit ratio / ceiling")
        axes[1][col].set_ylabel("TTFT p90 (ms)")
        axes[1][col].set_xlabel("gateway replicas")
        for ax in (axes[0][col], axes[1][col]):
            ax.grid(alpha=0.3)
            ax.set_xticks(sorted({n for c in series[workload].values() for n in c}))
    handles = {h.get_label(): h for ax in axes[0] for h in ax.get_lines()}
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=min(len(handles), 7), fontsize=8)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    path = img_dir / "bench-replicas.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
