"""The benchmark's workloads: seeded, parameterised lists of sessions to send.

A session is what one user does: a system prompt and one or more user turns, each turn sent once the previous
answer arrived, with that answer appended to the history (so each turn's prompt extends the last, as in a real
chat). Single-turn workloads are sessions of one turn. Sessions start open-loop at Poisson arrival times (or,
closed-loop, whenever one of a fixed number of slots frees up), so the same seed always sends the same prompts
in the same order.

Prompt text is made of common English words that are one Qwen2.5 token each (with their leading space), so a
prompt of N words is about N tokens and its size can be chosen without running the tokenizer.

A workload may name the fleet it is designed for (`Workload.workers`, `Workload.kv_tokens`; None means the run's
default, 4 workers of 12 288 KV tokens): the newer scenarios need eight workers and KV pools sized so they have
the pressure they claim. Every workload reports `params["working_set_tokens"]`, the distinct prompt tokens it
sends (counted as words, about one token each), so a report can state the fleet's KV fill (working set over
workers x KV tokens per worker), and `params["prompt_tokens"]`, all it sends: 1 - working set / prompt tokens is
the hit ratio no router can beat from empty caches.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Callable
from typing import Any

from cortexbench import trace

# The data model lives in sessions.py (trace.py builds on it without importing this module); its names stay
# importable from here.
from cortexbench.sessions import (  # noqa: F401
    WORDS,
    LazyTurns,
    Session,
    Workload,
    prompt_tokens,
    sizes,
    text,
    words,
    working_set_tokens,
)


def arrivals(rng: random.Random, n: int, rate: float) -> list[float]:
    """Poisson arrival times of n events at `rate` per second, starting at 0."""
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def shared_prefix(*, requests: int, rate: float, seed: int, prefixes: int = 8, prefix_words: int = 2500,
                  question_words: int = 24, max_tokens: int = 16) -> Workload:
    """Many users behind a few long system prompts, each asking a short distinct question."""
    rng = random.Random(seed)
    systems = [f"You are the assistant of team {k}. Rules and context follow.\n{text(rng, prefix_words)}"
               for k in range(prefixes)]
    times = arrivals(rng, requests, rate)
    sessions = tuple(Session(i, times[i], rng.choice(systems), (f"Question {i}: {text(rng, question_words)}?",),
                             max_tokens) for i in range(requests))
    return Workload("shared-prefix", sessions, {"requests": requests, "rate": rate, "seed": seed,
                                                "prefixes": prefixes, "prefix_words": prefix_words,
                                                "question_words": question_words, "max_tokens": max_tokens,
                                                **sizes(sessions)})


def multi_turn(*, requests: int, rate: float, seed: int, turns: int = 5, system_words: int = 1200,
               user_words: int = 80, max_tokens: int = 32) -> Workload:
    """Conversations that grow turn by turn: each turn's prompt is the last one plus its answer and a new
    question. `requests` counts turns; `rate` is the rate at which conversations start."""
    rng = random.Random(seed)
    n = max(1, requests // turns)
    times = arrivals(rng, n, rate)
    sessions = tuple(
        Session(i, times[i], f"Conversation {i}. Background:\n{text(rng, system_words)}",
                tuple(f"Turn {t}: {text(rng, user_words)}?" for t in range(turns)), max_tokens)
        for i in range(n))
    return Workload("multi-turn", sessions, {"requests": n * turns, "conversations": n, "rate": rate, "seed": seed,
                                             "turns": turns, "system_words": system_words,
                                             "user_words": user_words, "max_tokens": max_tokens,
                                             **sizes(sessions)})


def unique(*, requests: int, rate: float, seed: int, prompt_words: int = 2000, max_tokens: int = 16) -> Workload:
    """Long prompts that share nothing beyond the chat template: caching cannot help, routing can only cost."""
    rng = random.Random(seed)
    times = arrivals(rng, requests, rate)
    sessions = tuple(Session(i, times[i], f"Document {i}.\n{text(rng, prompt_words)}", ("Summarise it.",),
                             max_tokens) for i in range(requests))
    return Workload("unique", sessions, {"requests": requests, "rate": rate, "seed": seed,
                                         "prompt_words": prompt_words, "max_tokens": max_tokens,
                                         **sizes(sessions)})


def burst(*, requests: int, rate: float, seed: int, group_size: int = 4, prompt_words: int = 2000,
          max_tokens: int = 16) -> Workload:
    """Groups of identical prompts arriving together (a client sampling n answers); `rate` is groups per
    second, `requests` counts every copy."""
    rng = random.Random(seed)
    groups = max(1, requests // group_size)
    times = arrivals(rng, groups, rate)
    sessions: list[Any] = []
    for g in range(groups):
        system = f"Task {g}.\n{text(rng, prompt_words)}"
        sessions.extend(Session(g * group_size + k, times[g], system, ("Answer it.",), max_tokens, group=g)
                        for k in range(group_size))
    return Workload("burst", tuple(sessions), {"requests": groups * group_size, "groups": groups,
                                               "group_size": group_size, "rate": rate, "seed": seed,
                                               "prompt_words": prompt_words, "max_tokens": max_tokens,
                                               **sizes(sessions)})


def zipf_prefix(*, requests: int, rate: float, seed: int, prefixes: int = 128, prefix_words: int = 1500,
                zipf_s: float = 1.1, question_words: int = 24, max_tokens: int = 16, workers: int = 8,
                kv_tokens: int = 6144) -> Workload:
    """Eviction pressure: many more system prompts than the fleet can cache, their popularity Zipf-distributed
    (prompt k of `prefixes`, ranked from 0, is picked with weight 1 / (k + 1) ** zipf_s), each request a short
    distinct question behind one of them.

    Sized for 8 workers of 6 144 KV tokens (49 152 in all): the 128 prompts of ~1 500 tokens (192 000) are
    3.9 x the fleet's KV, and a run draws about 70 of them (300 requests) to 100 (600), a working set of 2.1-3 x
    the fleet; a worker holds four prompts, the fleet about 30, and the 26 most popular ones (what fits in 80 %
    of the fleet) carry 76 % of the requests at zipf_s 1.1. So a router that keeps each popular prompt on one
    worker and lets the tail be evicted there keeps most hits; one that spreads a prompt over several workers
    or sends it where it was evicted pays a 75 ms prefill. Offline, with an exact LRU per worker: an ideal
    router reaches ~0.64 (a cold start caps any router at ~0.76 over 300 requests), round-robin ~0.23; measured
    (quick, seed 1): oracle 0.62, round-robin 0.22. 8 requests a second by default: at 10 the oracle, which has
    all eight workers tokenize every prompt, fell behind on the 2-core machine (TTFT p90 2.5 s)."""
    rng = random.Random(seed)
    systems = [f"You are the assistant of product {k}. Rules and context follow.\n{text(rng, prefix_words)}"
               for k in range(prefixes)]
    cum = list(itertools.accumulate(1.0 / (k + 1) ** zipf_s for k in range(prefixes)))
    times = arrivals(rng, requests, rate)
    picks = rng.choices(range(prefixes), cum_weights=cum, k=requests)
    sessions = tuple(Session(i, times[i], systems[picks[i]], (f"Question {i}: {text(rng, question_words)}?",),
                             max_tokens) for i in range(requests))
    return Workload("zipf-prefix", sessions, {
        "requests": requests, "rate": rate, "seed": seed, "prefixes": prefixes, "prefix_words": prefix_words,
        "zipf_s": zipf_s, "question_words": question_words, "max_tokens": max_tokens,
        "distinct_prefixes": len(set(picks)), **sizes(sessions)},
        workers=workers, kv_tokens=kv_tokens)


def agentic(*, requests: int, rate: float, seed: int, system_words: int = 2000, task_words: int = 40,
            tool_words: tuple[int, int] = (300, 800), turns: tuple[int, int] = (4, 7), burst_share: float = 0.5,
            fanout: int = 4, max_tokens: int = 32, workers: int = 8, kv_tokens: int = 16384) -> Workload:
    """Tool-calling agents. An episode (starting at `rate` per second) is one agent or, with probability
    `burst_share`, `fanout` sub-agents arriving together with the same long system prompt (the tools and the
    repository's context, `system_words`) and different tasks. Each agent's first turn is its task; every later
    turn is a tool result of `tool_words` words, sent as a user message ("Tool result k: ...": the user role
    works with every contestant and simulator flavour; a `tool` message, which needs the assistant's tool call
    before it, was not verified through all of them), after the agent's answer
    (its tool call, `max_tokens`) arrived. So each prompt re-sends the whole, growing context plus a few hundred
    new tokens, and a sticky router pays only for those. `requests` counts turns (whole episodes are kept, so
    the figure reached may exceed it slightly); an agent has `turns` turns (inclusive range).

    Sized for 8 workers of 16 384 KV tokens: an agent's last prompt is at most ~7 100 tokens (2 000 + 40 + 6 x
    800 + 6 answers of 32), so two agents sharing a worker both fit, and a burst of four sub-agents on one
    worker shares its 2 000-token system prompt; the oracle keeps every context it built (measured, quick,
    seed 1: 0.818 against a ceiling of 0.814 counted in words). A run's whole
    working set is about the fleet's KV (quick: ~13 episodes) to 2.4 x (full: ~35): finished agents' contexts
    are evicted, live ones need not be. Each agent re-sends ~80 % of its prompt tokens, the ceiling for hits.
    Episodes start at 0.4 a second by default: ~5 requests a second of ~4 000 tokens, which the benchmark's
    oracle (it has every worker tokenize every prompt) still keeps up with on the 2-core machine."""
    rng = random.Random(seed)
    sessions: list[Session] = []
    episode, t, sent = 0, 0.0, 0
    while sent < requests:
        system = (f"You are agent team {episode}. Tools, rules and the repository's context follow.\n"
                  f"{text(rng, system_words)}")
        burst_ = rng.random() < burst_share
        for _ in range(fanout if burst_ else 1):
            i = len(sessions)
            n_turns = rng.randint(*turns)
            steps = [f"Task {i}: {text(rng, task_words)}."]
            steps += [f"Tool result {k}: {text(rng, rng.randint(*tool_words))}" for k in range(1, n_turns)]
            sessions.append(Session(i, t, system, tuple(steps), max_tokens, group=episode if burst_ else -1))
            sent += n_turns
        episode += 1
        t += rng.expovariate(rate)
    longest = max(words(s.system) + sum(words(x) for x in s.turns) + max_tokens * (len(s.turns) - 1)
                  for s in sessions)
    return Workload("agentic", tuple(sessions), {
        "requests": sent, "episodes": episode, "agents": len(sessions), "rate": rate, "seed": seed,
        "system_words": system_words, "task_words": task_words, "tool_words": list(tool_words),
        "turns": list(turns), "burst_share": burst_share, "fanout": fanout, "max_tokens": max_tokens,
        "longest_prompt_tokens": longest, **sizes(sessions)},
        workers=workers, kv_tokens=kv_tokens)


def at_rate(workload: Workload, rate: float) -> Workload:
    """The same workload with every arrival time scaled so that its rate (`params["rate"]`, what `--rate` sets:
    requests a second for the single-turn workloads and traces, session starts for multi-turn, groups for burst,
    episodes for agentic) becomes `rate`; prompts, order and turn structure unchanged."""
    base = workload.params.get("rate")
    if not base or rate <= 0:
        raise ValueError(f"{workload.name}: no arrival rate to scale (rate {base!r} -> {rate!r})")
    factor = base / rate
    sessions = tuple(dataclasses.replace(s, start=s.start * factor) for s in workload.sessions)
    params = {**workload.params, "rate": round(rate, 4)}
    if "replay_s" in params:
        params["replay_s"] = round(params["replay_s"] * factor, 1)
    if "time_scale" in params:
        params["time_scale"] = round(params["time_scale"] * factor, 6)
    return dataclasses.replace(workload, sessions=sessions, params=params)


def trace_replay(*, path: str, seed: int, **params: Any) -> Workload:
    """A Mooncake-format trace (cortexbench/trace.py)."""
    return trace.workload(path, seed=seed, **params)


BUILDERS: dict[str, Callable[..., Workload]] = {
    "shared-prefix": shared_prefix, "multi-turn": multi_turn, "unique": unique, "burst": burst,
    "zipf-prefix": zipf_prefix, "agentic": agentic, "trace": trace_replay}

# Requests and rates per workload: full runs, and --quick. Rates keep the simulated workers well below
# saturation on the 2-core development machine (the simulators, gateways and client share those cores): the
# first four are for 4 workers, the newer scenarios for the 8 they name. A quick run of a newer scenario
# replays at most ~40 s. The trace brings its own arrival times: `rate` rescales them to that mean rate,
# `requests` keeps the first lines (of the window `trace_start_s` / `trace_seconds`), `duration_s` the lines that
# arrive before it (replay time).
DEFAULTS: dict[str, dict[str, dict[str, Any]]] = {
    "full": {"shared-prefix": {"requests": 240, "rate": 8.0}, "multi-turn": {"requests": 160, "rate": 1.5},
             "unique": {"requests": 160, "rate": 6.0}, "burst": {"requests": 160, "rate": 2.0},
             "zipf-prefix": {"requests": 600, "rate": 8.0}, "agentic": {"requests": 480, "rate": 0.4},
             "trace": {}},
    "quick": {"shared-prefix": {"requests": 64, "rate": 8.0}, "multi-turn": {"requests": 60, "rate": 1.5},
              "unique": {"requests": 48, "rate": 6.0}, "burst": {"requests": 48, "rate": 2.0},
              "zipf-prefix": {"requests": 300, "rate": 8.0}, "agentic": {"requests": 180, "rate": 0.4},
              "trace": {"duration_s": 40.0}},
}


def build(name: str, *, quick: bool, seed: int, requests: int | None = None, rate: float | None = None,
          trace_path: str | None = None, trace_params: dict[str, Any] | None = None, **params: Any) -> Workload:
    """The workload `name` with its full or quick defaults; `requests`, `rate` and `params` override them.
    `trace_path` is the trace (file or WEKA directory) of the `trace` workload and `trace_params` more arguments
    of `trace.workload` (window, time scale, fleet, caps); both required or used there only, ignored by the
    others."""
    if name not in BUILDERS:
        raise ValueError(f"unknown workload {name!r} (known: {', '.join(BUILDERS)})")
    d = {**DEFAULTS["quick" if quick else "full"][name], **params}
    if requests:
        d["requests"] = requests
    if rate:
        d["rate"] = rate
    if name == "trace":
        if not trace_path:
            raise ValueError("the trace workload needs a trace: --trace FILE (Mooncake-format JSONL: a small one "
                             "ships as perf/traces/mooncake-small.jsonl, `python -m cortexbench.trace generate` "
                             "makes others) or a WEKA file or directory")
        return trace_replay(path=trace_path, seed=seed, **{**d, **(trace_params or {})})
    return BUILDERS[name](seed=seed, **d)
