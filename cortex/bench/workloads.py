"""The benchmark's workloads: seeded, parameterised lists of sessions to send.

A session is what one user does: a system prompt and one or more user turns, each turn sent once the previous
answer arrived, with that answer appended to the history (so each turn's prompt extends the last, as in a real
chat). Single-turn workloads are sessions of one turn. Sessions start open-loop at Poisson arrival times (or,
closed-loop, whenever one of a fixed number of slots frees up), so the same seed always sends the same prompts
in the same order.

Prompt text is made of common English words that are one Qwen2.5 token each (with their leading space), so a
prompt of N words is about N tokens and its size can be chosen without running the tokenizer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

# Each " word" below is a single Qwen2.5 token; tests/test_bench_smoke.py checks a sample against the tokenizer.
_VOCABULARY = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have "
    "an they you were her she there one all we their has been if more when will would who so no time can "
    "only other new some could these two may first then do any like my now over such our man me even "
    "most made after also did many before must through back years where much your way well down should "
    "because each just those people how too little state good very make world still own see men work "
    "long get here between both life being under never day same another know while last might us great "
    "old year off come since against go came right used take three place small found part general high "
    "end again upon few house public every number large group system water left during power city order "
    "line given away court early point human major family head young light market data social field "
    "table river music body open"
)
WORDS = tuple(_VOCABULARY.split())


@dataclass(frozen=True, slots=True)
class Session:
    id: int
    start: float
    """Seconds after the run's start (open loop); ignored closed-loop."""
    system: str
    turns: tuple[str, ...]
    max_tokens: int
    group: int = -1
    """Burst group (sessions of one group are identical and arrive together); -1 outside bursts."""
    affinity: str | None = None
    """The key a sticky balancer would keep on one replica; None: the session id."""

    def messages(self, history: list[dict[str, str]], turn: int) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.system}, *history, {"role": "user", "content": self.turns[turn]}]


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    sessions: tuple[Session, ...]
    params: dict[str, Any] = field(default_factory=dict)
    workers: int | None = None
    """The fleet this workload is designed for (None: the run's default)."""
    kv_tokens: int | None = None

    @property
    def requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)


def text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


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
                                                "question_words": question_words, "max_tokens": max_tokens})


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
                                             "user_words": user_words, "max_tokens": max_tokens})


def unique(*, requests: int, rate: float, seed: int, prompt_words: int = 2000, max_tokens: int = 16) -> Workload:
    """Long prompts that share nothing beyond the chat template: caching cannot help, routing can only cost."""
    rng = random.Random(seed)
    times = arrivals(rng, requests, rate)
    sessions = tuple(Session(i, times[i], f"Document {i}.\n{text(rng, prompt_words)}", ("Summarise it.",),
                             max_tokens) for i in range(requests))
    return Workload("unique", sessions, {"requests": requests, "rate": rate, "seed": seed,
                                         "prompt_words": prompt_words, "max_tokens": max_tokens})


def burst(*, requests: int, rate: float, seed: int, group_size: int = 4, prompt_words: int = 2000,
          max_tokens: int = 16) -> Workload:
    """Groups of identical prompts arriving together (a client sampling n answers); `rate` is groups per
    second, `requests` counts every copy."""
    rng = random.Random(seed)
    groups = max(1, requests // group_size)
    times = arrivals(rng, groups, rate)
    sessions = []
    for g in range(groups):
        system = f"Task {g}.\n{text(rng, prompt_words)}"
        sessions.extend(Session(g * group_size + k, times[g], system, ("Answer it.",), max_tokens, group=g)
                        for k in range(group_size))
    return Workload("burst", tuple(sessions), {"requests": groups * group_size, "groups": groups,
                                               "group_size": group_size, "rate": rate, "seed": seed,
                                               "prompt_words": prompt_words, "max_tokens": max_tokens})


BUILDERS = {"shared-prefix": shared_prefix, "multi-turn": multi_turn, "unique": unique, "burst": burst}

# Requests and rates per workload: full runs, and --quick. Rates keep 4 simulated workers well below
# saturation on the 2-core development machine (the simulators, gateways and client share those cores).
DEFAULTS: dict[str, dict[str, dict[str, Any]]] = {
    "full": {"shared-prefix": {"requests": 240, "rate": 8.0}, "multi-turn": {"requests": 160, "rate": 1.5},
             "unique": {"requests": 160, "rate": 6.0}, "burst": {"requests": 160, "rate": 2.0}},
    "quick": {"shared-prefix": {"requests": 64, "rate": 8.0}, "multi-turn": {"requests": 60, "rate": 1.5},
              "unique": {"requests": 48, "rate": 6.0}, "burst": {"requests": 48, "rate": 2.0}},
}


def build(name: str, *, quick: bool, seed: int, requests: int | None = None, rate: float | None = None,
          trace_path: str | None = None, **params: Any) -> Workload:
    d = DEFAULTS["quick" if quick else "full"][name]
    return BUILDERS[name](requests=requests or d["requests"], rate=rate or d["rate"], seed=seed, **params)
