"""What a benchmark workload is: sessions of chat turns (`Session`, turns possibly built lazily, `LazyTurns`), the
workload that holds them (`Workload`), the one-token-per-word vocabulary prompts are made of, and the sizes a
report states (working set, prompt tokens). workloads.py generates workloads from it and trace.py replays traces
into it; both import this module, which imports neither (docs/architecture.md "Layers": no import circles).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

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


class LazyTurns(Sequence[str]):
    """A session's turns whose text is built when each is sent, not when the workload is: a real trace's prompts
    (up to ~130 000 words each, thousands of them) would take gigabytes built at once. Equal when their keys
    are equal (the key names what the text is built from). `prepare`, if given, does ahead of a run what the
    builds can share (a trace's block texts, cached), so a build while the run's clock runs is one join."""

    __slots__ = ("_build", "_n", "_prepare", "key")

    def __init__(self, build: Callable[[int], str], n: int, key: Hashable,
                 prepare: Callable[[], object] | None = None) -> None:
        self._build, self._n, self.key, self._prepare = build, n, key, prepare

    def prepare(self) -> None:
        if self._prepare is not None:
            self._prepare()

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> str: ...

    @overload
    def __getitem__(self, i: slice) -> tuple[str, ...]: ...

    def __getitem__(self, i: int | slice) -> str | tuple[str, ...]:
        if isinstance(i, slice):
            return tuple(self._build(k) for k in range(self._n)[i])
        if not -self._n <= i < self._n:
            raise IndexError(i)
        return self._build(i % self._n)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LazyTurns) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        return f"LazyTurns({self._n}, key={self.key!r})"


@dataclass(frozen=True, slots=True)
class Session:
    id: int
    start: float
    """Seconds after the run's start (open loop); ignored closed-loop."""
    system: str
    turns: Sequence[str]
    """A tuple of texts, or LazyTurns built when sent (a trace's long prompts)."""
    max_tokens: int
    group: int = -1
    """Burst group: sessions that arrive together (in `burst` identical copies, in `agentic` sub-agents sharing
    one system prompt); -1 outside bursts."""
    affinity: str | None = None
    """The key a sticky balancer would keep together (a trace's session id); None means this session's id."""

    def messages(self, history: list[dict[str, str]], turn: int, content: str | None = None
                 ) -> list[dict[str, str]]:
        """The chat to send for `turn`; `content` is that turn's text when the caller already built it."""
        return [{"role": "system", "content": self.system}, *history,
                {"role": "user", "content": self.turns[turn] if content is None else content}]


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    sessions: tuple[Session, ...]
    params: dict[str, Any] = field(default_factory=dict)
    workers: int | None = None
    """Workers the workload is designed for; None: the run's default (4)."""
    kv_tokens: int | None = None
    """KV pool per worker, in tokens, the workload is designed for; None: the run's default (12 288)."""
    max_model_len: int | None = None
    """The context the workers must accept (a real trace's prompts run past the simulator's default of
    min(32 768, KV pool)); None: that default. Capped at the fleet's KV pool per worker."""

    @property
    def requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    def kv_fill(self, workers: int, kv_tokens: int) -> float:
        """The working set over the fleet's KV: above 1 the fleet cannot hold everything sent, whatever the
        routing, and eviction decides part of the hit ratio."""
        return self.params["working_set_tokens"] / (workers * kv_tokens)


def text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def words(s: str) -> int:
    """Tokens of a prompt part, roughly: its words (each vocabulary word is one token; a number or punctuation
    mark glued to a word may add one)."""
    return len(s.split())


def working_set_tokens(sessions: Iterable[Session]) -> int:
    """Distinct prompt tokens a list of chat sessions sends: each distinct system prompt once, plus each
    session's turns and the answers they carry forward (at most max_tokens each; the last answer is never sent).
    Identical sessions (a burst group) count once."""
    systems: dict[str, int] = {}
    seen: set[tuple[str, Sequence[str]]] = set()
    total = 0
    for s in sessions:
        systems.setdefault(s.system, words(s.system))
        if (s.system, s.turns) in seen:
            continue
        seen.add((s.system, s.turns))
        total += sum(words(t) for t in s.turns) + s.max_tokens * (len(s.turns) - 1)
    return total + sum(systems.values())


def prompt_tokens(sessions: Iterable[Session]) -> int:
    """Prompt tokens a list of chat sessions sends in all, each turn re-sending the history (answers counted at
    max_tokens, which the simulated workers always produce)."""
    total = 0
    for s in sessions:
        context = words(s.system)
        for k, turn in enumerate(s.turns):
            context += words(turn) + (s.max_tokens if k else 0)
            total += context
    return total


def sizes(sessions: Iterable[Session]) -> dict[str, int]:
    """`working_set_tokens` and `prompt_tokens` of a workload's params. 1 - working set / prompt tokens is the
    best hit ratio any router can reach from empty caches with unlimited KV: the rest is sent for the first
    time."""
    sessions = list(sessions)
    return {"working_set_tokens": working_set_tokens(sessions), "prompt_tokens": prompt_tokens(sessions)}
