"""Trace replay beyond the shipped synthetic trace, pure: windows of a Mooncake trace, the WEKA agentic-coding
format (namespaced hash ids, staggered conversations, cut pauses, sub-agents), format detection, the prompt cap,
lazily built prompts, the fleet a trace gets, and the command line's trace options. The real public traces in
../shared/traces are checked where that directory exists (skipped with a reason elsewhere). No process is
started."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cortexbench import cli, runner, trace, trace_lines, trace_mooncake, trace_prompts, trace_weka, workloads
from cortexbench.launch import ClusterSpec
from cortexbench.workloads import LazyTurns, Session, Workload, at_rate, build

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO / "../shared/traces"
MOONCAKE = SHARED / "conversation_trace.jsonl"
WEKA = SHARED / "kv-cache-tester"
needs_shared = pytest.mark.skipif(not (MOONCAKE.exists() and WEKA.is_dir()),
                                  reason=f"the public traces are not at {SHARED.resolve()} (see that README)")
B = trace_mooncake.BLOCK_TOKENS


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _mooncake_rows() -> list[dict[str, Any]]:
    # Arrivals at 0, 2, 4, ... 18 s; prompt i is i + 1 blocks long, all sharing block 0.
    return [{"timestamp": 2000 * i, "input_length": B * (i + 1), "output_length": 10, "hash_ids": list(range(i + 1))}
            for i in range(10)]


def _req(t: float, n_in: int, ids: list[int], out: int = 20) -> dict[str, Any]:
    return {"t": t, "type": "n", "in": n_in, "out": out, "hash_ids": ids}


def _conv(cid: str, requests: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": cid, "block_size": 64, "hash_id_scope": "local", "requests": requests}


# ---- Mooncake windows ----

def test_window_is_trace_time_from_the_first_arrival() -> None:
    lines = trace_mooncake.parse(json.dumps(r) for r in _mooncake_rows())
    assert [ln.timestamp_ms for ln in trace_lines.window(lines, 4.0, 6.0)] == [4000, 6000, 8000]  # [4, 10) s
    assert [ln.timestamp_ms for ln in trace_lines.window(lines, 15.0)] == [16000, 18000]
    assert trace_lines.window(lines, 0.0, None) == lines
    assert trace_lines.window(lines, 100.0, 5.0) == []


def test_trace_workload_window_scale_rate_and_requests(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "t.jsonl", _mooncake_rows())
    w = build("trace", quick=False, seed=1, trace_path=str(path),
              trace_params={"trace_start_s": 4.0, "trace_seconds": 10.0})
    assert [s.start for s in w.sessions] == [0.0, 2.0, 4.0, 6.0, 8.0]  # lines at 4..12 s, from the window's first
    assert [workloads.words(s.turns[0]) for s in w.sessions] == [B * k for k in (3, 4, 5, 6, 7)]
    assert w.params["trace_start_s"] == 4.0 and w.params["trace_seconds"] == 10.0 and w.params["trace_lines"] == 10
    scaled = build("trace", quick=False, seed=1, trace_path=str(path),
                   trace_params={"trace_start_s": 4.0, "trace_seconds": 10.0, "time_scale": 0.25})
    assert [s.start for s in scaled.sessions] == [0.0, 0.5, 1.0, 1.5, 2.0]
    # --rate overrides the time scale; --requests keeps the window's first lines.
    fast = build("trace", quick=False, seed=1, trace_path=str(path), rate=2.0, requests=3,
                 trace_params={"trace_start_s": 4.0, "time_scale": 0.25})
    assert [s.start for s in fast.sessions] == [0.0, 0.5, 1.0] and fast.params["rate"] == 2.0
    # Quick: the first 40 s of replay, after the window and the scale.
    quick = build("trace", quick=True, seed=1, trace_path=str(path), trace_params={"time_scale": 10.0})
    assert [s.start for s in quick.sessions] == [0.0, 20.0]
    with pytest.raises(trace_lines.TraceError, match="no request in the window"):
        build("trace", quick=False, seed=1, trace_path=str(path), trace_params={"trace_start_s": 60.0})


def test_mooncake_lines_without_session_are_their_own_sessions(tmp_path: Path) -> None:
    w = build("trace", quick=False, seed=1, trace_path=str(_jsonl(tmp_path / "t.jsonl", _mooncake_rows())))
    assert all(s.affinity is None for s in w.sessions) and len({s.id for s in w.sessions}) == 10
    assert w.params["format"] == "mooncake" and w.params["sessions"] == 0


def test_max_input_keeps_the_first_blocks(tmp_path: Path) -> None:
    ln = trace_lines.Line(1, 0.0, 3 * B + 100, 5, (7, 8, 9, 10))
    assert trace_lines.cap(ln, 10 * B, B) is ln
    cut = trace_lines.cap(ln, 2 * B, B)
    assert (cut.input_length, cut.hash_ids) == (2 * B, (7, 8))
    part = trace_lines.cap(ln, B + 1, B)
    assert (part.input_length, part.hash_ids) == (B + 1, (7, 8))
    assert trace_prompts.prompt_text(part).split() == [*trace_prompts.block_words(7), trace_prompts.block_words(8)[0]]
    path = _jsonl(tmp_path / "t.jsonl", _mooncake_rows())
    w = build("trace", quick=False, seed=1, trace_path=str(path), trace_params={"max_input": 3 * B})
    assert [workloads.words(s.turns[0]) for s in w.sessions] == [B, 2 * B] + [3 * B] * 8
    assert w.params["cut_to_max_input"] == 7 and w.params["longest_prompt_tokens"] == 3 * B


def test_prompts_are_built_when_sent_and_equal_the_blocks_text(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "t.jsonl", _mooncake_rows())
    w = build("trace", quick=False, seed=1, trace_path=str(path))
    turns = w.sessions[2].turns
    assert isinstance(turns, LazyTurns) and len(turns) == 1
    text = turns[0]
    assert text.split() == [*trace_prompts.block_words(0), *trace_prompts.block_words(1), *trace_prompts.block_words(2)]
    assert turns[-1] == text and turns[:] == (text,) and text == build(
        "trace", quick=False, seed=1, trace_path=str(path)).sessions[2].turns[0]
    with pytest.raises(IndexError):
        turns[1]
    # Equal by what they are built from, so sessions compare and hash as before.
    assert w.sessions[2] == build("trace", quick=False, seed=1, trace_path=str(path)).sessions[2]
    assert len({s.turns for s in w.sessions}) == 10
    msgs = w.sessions[2].messages([], 0, "prebuilt")
    assert msgs == [{"role": "system", "content": trace.SYSTEM}, {"role": "user", "content": "prebuilt"}]


def test_a_partial_last_block_is_cut_to_the_line_and_whole_blocks_are_joined_once() -> None:
    ln = trace_lines.Line(1, 0.0, 2 * 64 + 5, 1, (3, 4, 5))
    words = trace_prompts.prompt_text(ln, 64).split()
    assert words == [*trace_prompts.block_words(3, 64), *trace_prompts.block_words(4, 64),
                     *trace_prompts.block_words(5, 64)[:5]]
    assert trace_prompts.block_text(3, 64) == " ".join(trace_prompts.block_words(3, 64))
    assert trace_prompts.distinct_tokens([ln, trace_lines.Line(2, 0.0, 3 * 64, 1, (3, 4, 5))], 64) == 3 * 64
    assert trace_prompts.distinct_tokens([ln, trace_lines.Line(2, 0.0, 64 + 9, 1, (3, 9))], 64) == 2 * 64 + 5 + 9


# ---- WEKA ----

def test_weka_conversations_are_namespaced_staggered_and_cut_at_long_pauses() -> None:
    a = _conv("conv-a", [_req(0.0, 200, [1, 2, 3]), _req(10.0, 300, [1, 2, 3, 4]), _req(5000.0, 64, [1])])
    b = _conv("conv-b", [_req(0.0, 128, [1, 2]), _req(30.0, 130, [1, 2])])
    lines, bs = trace_weka.weka_lines([("a.json", a), ("b.json", b)], max_idle_s=60.0, conversation_gap_s=100.0)
    assert bs == 64
    by = {(ln.session_id, ln.number): ln for ln in lines}
    # Conversation a at 0 s: 0, 10, then 10 + 60 (a pause of 4 990 s cut to 60); b at 100 s: 100, 130.
    assert [(ln.session_id, ln.timestamp_ms) for ln in lines] == [
        ("conv-a", 0.0), ("conv-a", 10000.0), ("conv-a", 70000.0), ("conv-b", 100000.0), ("conv-b", 130000.0)]
    # Same local ids, different conversations: no block in common. Within one, the prefix is shared.
    a_ids = {h for (cid, _), ln in by.items() if cid == "conv-a" for h in ln.hash_ids}
    b_ids = {h for (cid, _), ln in by.items() if cid == "conv-b" for h in ln.hash_ids}
    assert not a_ids & b_ids
    assert by["conv-a", 2].hash_ids[:3] == by["conv-a", 1].hash_ids[:3]
    assert by["conv-a", 3].hash_ids == by["conv-a", 1].hash_ids[:1]
    # 200 tokens = 3 whole blocks + 8 tokens: one more block, unique to the request; 128 = 2 whole blocks.
    assert len(by["conv-a", 1].hash_ids) == 4 and by["conv-a", 1].hash_ids[3] not in by["conv-a", 2].hash_ids
    assert len(by["conv-b", 1].hash_ids) == 2 and len(by["conv-b", 2].hash_ids) == 3
    assert by["conv-b", 2].hash_ids[:2] == by["conv-b", 1].hash_ids
    assert (trace_prompts.prompt_text(by["conv-a", 1], 64).split()[:192]
            == trace_prompts.prompt_text(by["conv-a", 2], 64).split()[:192])
    assert len(trace_prompts.prompt_text(by["conv-a", 1], 64).split()) == 200
    # The namespace is the conversation's own, whatever else is loaded with it.
    alone, _ = trace_weka.weka_lines([("b.json", b)], conversation_gap_s=100.0)
    assert [ln.hash_ids for ln in alone] == [by["conv-b", 1].hash_ids, by["conv-b", 2].hash_ids]
    assert trace_weka.weka_lines([("a.json", a)], max_idle_s=float("inf"))[0][-1].timestamp_ms == 5_000_000.0


def test_weka_subagents_start_at_their_parents_time_with_their_own_pauses_cut() -> None:
    sub = {"t": 20.0, "type": "subagent", "agent_id": "agent_001",
           "requests": [_req(0.0, 100, [50]), _req(500.0, 150, [50, 51])]}
    doc = _conv("c", [_req(0.0, 64, [1]), sub, _req(1000.0, 128, [1, 2])])
    lines, _ = trace_weka.weka_lines([("c.json", doc)], max_idle_s=60.0)
    assert [(ln.timestamp_ms, ln.input_length) for ln in lines] == [(0.0, 64), (20000.0, 100), (80000.0, 150),
                                                                    (80000.0, 128)]
    assert {ln.session_id for ln in lines} == {"c"}
    assert lines[1].hash_ids[0] == lines[2].hash_ids[0] and lines[1].hash_ids[0] != lines[0].hash_ids[0]


@pytest.mark.parametrize(("doc", "says"), [
    ({"id": "x", "requests": [{"t": 0, "in": 10, "out": 1}]}, r"requests\[0\]: hash_ids"),
    ({"id": "x", "requests": [{"t": -1, "in": 10, "out": 1, "hash_ids": []}]}, r"requests\[0\]: t must be"),
    ({"id": "x", "requests": [{"t": 0, "in": 0, "out": 1, "hash_ids": []}]}, r"requests\[0\]: in must be >= 1"),
    ({"id": "x", "requests": [{"t": 0, "in": 64, "out": 1, "hash_ids": [1, 2, 3]}]}, "more than in=64 needs"),
    ({"id": "x", "block_size": 0, "requests": []}, "block_size must be"),
    ({"id": "x", "requests": [{"t": 0, "type": "subagent"}]}, "needs a requests list"),
])
def test_weka_bad_requests_name_file_and_request(tmp_path: Path, doc: dict[str, Any], says: str) -> None:
    path = tmp_path / "trace_0001.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(trace_lines.TraceError, match=says) as exc:
        trace.read(path)
    assert str(path) in str(exc.value)


def test_format_is_told_by_content_and_a_directory_holds_weka_files(tmp_path: Path) -> None:
    one = tmp_path / "trace_0002.json"
    one.write_text(json.dumps(_conv("two", [_req(0.0, 64, [1])])))
    (tmp_path / "trace_0001.json").write_text(json.dumps(_conv("one", [_req(0.0, 64, [1]), _req(5.0, 64, [1])])))
    (tmp_path / "SHA256SUMS").write_text("not a trace\n")
    single = trace.read(one)
    assert single.format == "weka" and single.block_tokens == 64 and single.conversations == 1
    both = trace.read(tmp_path, conversation_gap_s=1.0)
    assert both.format == "weka" and both.conversations == 2
    assert [(ln.session_id, ln.timestamp_ms) for ln in both.lines] == [("one", 0.0), ("two", 1000.0),
                                                                        ("one", 5000.0)]
    moon = trace.read(_jsonl(tmp_path / "m.jsonl", _mooncake_rows()[:1]))  # one line: a JSON object, not WEKA
    assert moon.format == "mooncake" and moon.block_tokens == B
    assert trace.read(_jsonl(tmp_path / "m2.jsonl", _mooncake_rows())).format == "mooncake"
    with pytest.raises(trace_lines.TraceError, match=r"no WEKA trace files"):
        trace.read(_empty_dir(tmp_path))
    (tmp_path / "trace_0003.json").write_text(json.dumps({**_conv("three", [_req(0.0, 64, [1])]), "block_size": 16}))
    with pytest.raises(trace_lines.TraceError, match="block_size 16 differs"):
        trace.read(tmp_path)


def _empty_dir(tmp_path: Path) -> Path:
    d = tmp_path / "empty"
    d.mkdir()
    return d


def test_weka_workload_sessions_carry_the_conversation_as_affinity(tmp_path: Path) -> None:
    (tmp_path / "trace_0001.json").write_text(json.dumps(_conv("one", [_req(0.0, 640, list(range(10))),
                                                                         _req(5.0, 700, list(range(10)))])))
    (tmp_path / "trace_0002.json").write_text(json.dumps(_conv("two", [_req(0.0, 64, [0])])))
    w = build("trace", quick=False, seed=1, trace_path=str(tmp_path), trace_params={"conversation_gap_s": 2.0})
    assert [(s.start, s.affinity) for s in w.sessions] == [(0.0, "one"), (2.0, "two"), (5.0, "one")]
    assert [workloads.words(s.turns[0]) for s in w.sessions] == [640, 64, 700]
    assert w.params["format"] == "weka" and w.params["block_tokens"] == 64 and w.params["conversations"] == 2
    # Distinct tokens: conversation one's 10 blocks + its 60-token tail, two's one block, and the system prompt.
    assert w.params["working_set_tokens"] == 10 * 64 + 60 + 64 + workloads.words(trace.SYSTEM)


# ---- the fleet a trace gets ----

def test_default_fleet_fits_the_longest_prompt() -> None:
    assert trace.default_kv_tokens(10240) == trace.SMALL_KV_TOKENS == 16384
    assert trace.default_kv_tokens(126195) == trace.LARGE_KV_TOKENS == 262144
    assert trace.default_kv_tokens(trace.MAX_INPUT) == 262144
    assert trace.default_kv_tokens(300_000) == 524288


def test_fleet_of_takes_each_override_and_the_context_length(tmp_path: Path) -> None:
    w = Workload("trace", (Session(0, 0.0, "s", ("q",), 4),), {"working_set_tokens": 1}, workers=8,
                 kv_tokens=262144, max_model_len=262144)
    plan = runner.Plan(cluster=ClusterSpec(), workloads=[[w]], contestants=[])
    assert runner.fleet_of(w, plan) == ClusterSpec(workers=8, kv_tokens=262144, max_model_len=262144)
    plan.override_workers = 2
    assert runner.fleet_of(w, plan) == ClusterSpec(workers=2, kv_tokens=262144, max_model_len=262144)
    plan.override_kv_tokens = 65536
    assert runner.fleet_of(w, plan) == ClusterSpec(workers=2, kv_tokens=65536, max_model_len=65536)
    plain = Workload("unique", w.sessions, w.params)
    assert runner.fleet_of(plain, runner.Plan(cluster=ClusterSpec(), workloads=[], contestants=[])) == ClusterSpec()
    args = ClusterSpec(kv_tokens=65536, max_model_len=131072).sim_args()
    assert args[args.index("--max-model-len") + 1] == "65536" and "--max-model-len" not in ClusterSpec().sim_args()


def test_the_shipped_trace_keeps_its_fleet_and_the_real_ones_get_a_large_one(tmp_path: Path) -> None:
    small = build("trace", quick=True, seed=1, trace_path=str(REPO / "perf" / "traces" / "mooncake-small.jsonl"))
    assert (small.workers, small.kv_tokens) == (8, 16384)
    rows = [{"timestamp": 0, "input_length": 100_000, "output_length": 5, "hash_ids": list(range(196))}]
    big = build("trace", quick=True, seed=1, trace_path=str(_jsonl(tmp_path / "t.jsonl", rows)))
    assert (big.workers, big.kv_tokens, big.max_model_len) == (8, 262144, 262144)
    given = build("trace", quick=True, seed=1, trace_path=str(tmp_path / "t.jsonl"),
                  trace_params={"workers": 3, "kv_tokens": 131072})
    assert (given.workers, given.kv_tokens, given.max_model_len) == (3, 131072, 131072)


# ---- arrival times scaled to a rate (what --goodput searches over) ----

def test_at_rate_scales_arrivals_and_keeps_prompts() -> None:
    w = build("shared-prefix", quick=True, seed=1, requests=10, rate=8.0)
    fast = at_rate(w, 16.0)
    assert [s.start for s in fast.sessions] == pytest.approx([s.start / 2 for s in w.sessions])
    assert [s.turns for s in fast.sessions] == [s.turns for s in w.sessions] and fast.params["rate"] == 16.0
    # Rebuilding at the rate draws the same prompts at the same (scaled) times.
    assert [s.start for s in build("shared-prefix", quick=True, seed=1, requests=10, rate=16.0).sessions] \
        == pytest.approx([s.start for s in fast.sessions])
    assert at_rate(w, 8.0).sessions == w.sessions


def test_at_rate_of_a_trace_updates_its_replay_figures(tmp_path: Path) -> None:
    w = build("trace", quick=False, seed=1, trace_path=str(_jsonl(tmp_path / "t.jsonl", _mooncake_rows())))
    assert w.params["rate"] == 0.5 and w.params["replay_s"] == 18.0
    slow = at_rate(w, 0.25)
    assert slow.params["replay_s"] == 36.0 and slow.params["time_scale"] == 2.0
    assert max(s.start for s in slow.sessions) == pytest.approx(36.0)
    with pytest.raises(ValueError, match="no arrival rate"):
        at_rate(Workload("x", (), {"rate": None}), 1.0)


# ---- the command line ----

def _args(*argv: str) -> Any:
    return cli._parser().parse_args(list(argv))


def test_trace_options_go_to_the_trace_workload_only() -> None:
    args = _args("--trace", "t.jsonl", "--trace-start", "600", "--trace-seconds", "90", "--time-scale", "0.5",
                 "--kv-tokens", "262144")
    assert cli._names(args) == ["trace"]  # --trace alone runs the trace
    assert cli._trace_params(args) == {"trace_start_s": 600.0, "trace_seconds": 90.0, "time_scale": 0.5,
                                       "kv_tokens": 262144}
    assert cli._trace_params(_args("--trace", "d", "--max-input", "65536", "--max-idle", "inf",
                                   "--conversation-gap", "5")) == {"max_input": 65536, "max_idle_s": float("inf"),
                                                                   "conversation_gap_s": 5.0}
    assert cli._names(_args()) == list(cli.DEFAULT_WORKLOADS)
    with pytest.raises(SystemExit, match="--trace-seconds apply to the trace workload only"):
        cli._names(_args("--workload", "unique", "--trace-seconds", "5"))
    with pytest.raises(SystemExit, match="needs --trace PATH"):
        cli._names(_args("--workload", "trace"))
    with pytest.raises(SystemExit, match="cannot read the trace"):
        cli._build(_args("--trace", "/nonexistent/t.jsonl"), ["trace"], (1,))


# ---- windows as seeds ----

def test_several_windows_are_the_trace_workloads_seeds(tmp_path: Path) -> None:
    # Two windows of the 10-line trace: [0, 6) s has lines 0-2, [10, 16) s lines 5-7 (the longer prompts).
    path = _jsonl(tmp_path / "t.jsonl", _mooncake_rows())
    args = _args("--trace", str(path), "--trace-start", "0,10", "--trace-seconds", "6", "--workload", "trace",
                 "--workload", "unique", "--quick")
    assert cli._starts(args) == (0.0, 10.0) and "trace_start_s" not in cli._trace_params(args)
    built = cli._build(args, cli._names(args), (1, 2))
    windows, unique = built
    assert [w.params["seed"] for w in windows] == [0, 10] and [w.params["trace_start_s"] for w in windows] == [0, 10]
    assert [w.requests for w in windows] == [3, 3] and [u.params["seed"] for u in unique] == [1, 2]  # others: --seeds
    assert windows[1].sessions[0].turns[0].split()[:B] == list(trace_prompts.block_words(0))
    params = runner.cell_params(windows)
    assert params["seeds"] == [0, 10] and params["trace_start_s"] == [0.0, 10.0] and params["requests"] == 3
    assert params["trace_seconds"] == 6.0  # the same in both windows: shown once
    assert params["working_set_tokens"] == [w.params["working_set_tokens"] for w in windows]
    assert runner.cell_params(unique)["seeds"] == [1, 2]
    # A trace's tables go by the file replayed, so two traces in one report keep apart.
    assert runner.title(windows[0]) == "trace (t)" and runner.title(unique[0]) == "unique"
    assert runner.title(build("trace", quick=True, seed=1, trace_path=str(REPO / "perf/traces/mooncake-small.jsonl"))
                        ) == "trace (mooncake-small)"


@pytest.mark.parametrize(("spec", "says"), [
    ("0,0", "whole, different"), ("0.5,10", "whole, different"), ("-1", ">= 0"), ("x", "takes seconds"),
    ("inf", ">= 0")])
def test_bad_windows_are_refused(spec: str, says: str) -> None:
    with pytest.raises(SystemExit, match=says):
        cli._starts(_args("--trace", "t.jsonl", "--trace-start", spec))


def test_windows_share_the_largest_fleet() -> None:
    small = Workload("trace", (), {}, workers=8, kv_tokens=16384, max_model_len=16384)
    large = Workload("trace", (), {}, workers=8, kv_tokens=262144, max_model_len=262144)
    assert trace.same_fleet([small, small]) == [small, small]
    assert [(w.kv_tokens, w.max_model_len) for w in trace.same_fleet([small, large])] == [(262144, 262144)] * 2


# ---- prompts built before the clock starts, and a client that cannot keep up ----

def test_prepare_builds_every_block_before_the_run(tmp_path: Path) -> None:
    from cortexbench import client

    rows = [{"timestamp": 0, "input_length": 3 * B - 10, "output_length": 5, "hash_ids": [9001, 9002, 9003]}]
    w = build("trace", quick=False, seed=1, trace_path=str(_jsonl(tmp_path / "t.jsonl", rows)))
    trace_prompts.block_text.cache_clear()
    trace_prompts.block_words.cache_clear()
    client.prepare(w)
    built = trace_prompts.block_text.cache_info().currsize
    # Two whole blocks joined, the cut one's words.
    assert built == 2 and trace_prompts.block_words.cache_info().currsize == 3
    text = w.sessions[0].turns[0]
    assert (trace_prompts.block_text.cache_info().currsize == built
            and trace_prompts.block_text.cache_info().misses == built)
    assert workloads.words(text) == 3 * B - 10
    # The words are a function of the id alone: the same in every process (a digest, not Python's hash).
    assert trace_prompts.block_words(9001) == trace_prompts.block_words.__wrapped__(9001)
    assert (len(set(trace_prompts.block_words(9001))) > 100
            and set(trace_prompts.block_words(9001)) <= set(workloads.WORDS))


def test_send_lag_is_summarized_and_flagged() -> None:
    from cortexbench import metrics, report
    from cortexbench.client import Record, RunResult

    def rec(i: int, lag: float | None) -> Record:
        return Record(i, 0, float(i), ttft=0.1, e2e=0.2, prompt_tokens=100, cached_tokens=0, worker="w", status=200,
                      lag=lag)

    on_time = metrics.summarize(RunResult([rec(i, 0.001) for i in range(10)], 5.0))
    assert on_time["send_lag_ms"] == {"p50": 1.0, "p99": 1.0, "max": 1.0}
    late = metrics.summarize(RunResult([rec(i, 0.001) for i in range(9)] + [rec(9, 0.5)], 5.0))
    assert late["send_lag_ms"] == {"p50": 1.0, "p99": 500.0, "max": 500.0}
    assert "send_lag_ms" not in metrics.summarize(RunResult([rec(0, None)], 5.0))  # closed loop: no schedule
    assert metrics.records_json([rec(0, 0.25)])[0]["lag_ms"] == 250.0
    cpu = {"gateway_cpu_ms_per_request": 0}
    block = {"params": {"seeds": [1]}, "results": {"a": {**on_time, **cpu}, "b": {**late, **cpu}}}
    text = report.workload_table("trace", block)
    assert "b: the client sent behind schedule: first requests' send lag p99 500.0 ms" in text
    assert "a: the client" not in text


def test_trace_info_prints_a_window(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _jsonl(tmp_path / "t.jsonl", _mooncake_rows())
    assert trace.main(["info", str(path), "--trace-start", "4", "--trace-seconds", "6", "--max-input", "1024"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["format"] == "mooncake" and out["trace_lines"] == 10 and out["lines"] == 3
    assert out["window"] == {"start_s": 4.0, "seconds": 6.0} and out["cut_to_max_input"] == 3
    assert out["input_length"]["max"] == 1024 and out["default_fleet"] == {"workers": 8, "kv_tokens_per_worker": 16384}
    assert trace.main(["info", str(path), "--trace-start", "99"]) == 2


# ---- the real traces, where they lie ----

@needs_shared
def test_real_mooncake_window_replays_on_its_fleet() -> None:
    w = build("trace", quick=False, seed=1, trace_path=str(MOONCAKE),
              trace_params={"trace_start_s": 600.0, "trace_seconds": 90.0})
    assert w.params["trace_lines"] == 12031 and 250 <= w.requests <= 400
    assert max(s.start for s in w.sessions) < 90.0 and all(s.affinity is None for s in w.sessions)
    assert (w.workers, w.kv_tokens, w.max_model_len) == (8, 262144, 262144)
    assert w.params["longest_prompt_tokens"] + 200 < w.kv_tokens
    first = w.sessions[0].turns[0]
    assert first.split()[:512] == list(trace_prompts.block_words(0))  # every request starts with the same system block


@needs_shared
def test_real_weka_directory_loads_every_conversation_apart() -> None:
    tr = trace.read(WEKA)
    assert tr.format == "weka" and tr.block_tokens == 64 and tr.conversations >= 29
    assert len(tr.lines) >= 3000 and len({ln.session_id for ln in tr.lines}) == tr.conversations
    owner: dict[int, str | None] = {}
    for ln in tr.lines[::7]:
        for h in ln.hash_ids:
            assert owner.setdefault(h, ln.session_id) == ln.session_id  # no block across conversations
    w = build("trace", quick=False, seed=1, trace_path=str(WEKA), requests=40)
    assert w.params["longest_prompt_tokens"] <= trace.MAX_INPUT and (w.workers, w.kv_tokens) == (8, 262144)
    assert w.params["format"] == "weka" and w.params["sessions"] == w.params["conversations"]
    assert [s.affinity for s in w.sessions] == [ln.session_id for ln in tr.lines[:40]]
    assert [workloads.words(s.turns[0]) for s in w.sessions[:3]] == [min(ln.input_length, trace.MAX_INPUT)
                                                                     for ln in tr.lines[:3]]
