"""extproc's Prometheus series. With PROMETHEUS_MULTIPROC_DIR set (cortex run sets it), every extproc process
writes its samples to files there and ingest's /metrics serves the sum: one scrape target per gateway."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import Counter, Gauge, Histogram

from cortex.chain_cache import ChainCache
from cortex.gc_pauses import BUCKETS as gc_pause_buckets
from extproc.breaker import LEVEL, State
from extproc.plan import RoutePlan

# `model` is the configured model that serves the request (an alias's target): bounded by the config, and what the
# dashboard's model variable and CortexFallbackRateHigh group by.
DECISIONS = Counter("cortex_route_decisions", "routing decisions by model, match mode and reason",
                    ["model", "mode", "reason"])
HTTP_ENDS = Counter("cortex_http_decision_ends",
                    "extproc.transport http: requests released, by what told their end", ["source"])
CLIENT_ERRORS = Counter("cortex_client_errors", "requests refused by Cortex with a 4xx/5xx", ["status"])
INTERNAL_ERRORS = Counter("cortex_extproc_internal_errors",
                          "requests sent to the fallback route because routing raised")
HIT_TOKENS = Counter("cortex_claimed_cache_hit_tokens", "prompt tokens Cortex claimed as cached on the chosen worker",
                     ["model"])
RANDOM_HIT_TOKENS = Counter("cortex_random_choice_hit_tokens",
                            "prompt tokens a worker drawn at random from the same candidates would have had cached, "
                            "by the same ledger (the mean over the candidates): routing gain = claimed / this",
                            ["model"])
PROMPT_TOKENS = Counter("cortex_routed_prompt_tokens", "prompt tokens of routed requests", ["model"])
LOWER_TIER_TOKENS = Counter("cortex_lower_tier_hit_tokens",
                            "prompt tokens of the chosen worker's hit that a lower tier holds (loaded, not computed), "
                            "by tier and whether they were claimed (the engine counts them in cached_tokens)",
                            ["medium", "claimed"])
WINDOW_WITHHELD_TOKENS = Counter("cortex_window_withheld_tokens",
                                 "prompt tokens a hybrid model's chosen worker held in its full-attention group but "
                                 "not in the blocks its sliding windows need: never claimed (a full-attention-only "
                                 "match would have)")
_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
GC_PAUSE_SECONDS = Histogram("cortex_extproc_gc_pause_seconds", "garbage-collector pauses of the extproc processes, "
                             "by generation (2: a full collection; cortex/gc_pauses.py)", ["generation"],
                             buckets=gc_pause_buckets)
GC_FROZEN_OBJECTS = Gauge("cortex_extproc_gc_frozen_objects", "objects the extproc processes keep out of the "
                          "collector's walk since start-up or the last reload (the fewest of the live processes: 0 "
                          "means one did not settle its heap)", multiprocess_mode="livemin")
DECISION_SECONDS = Histogram("cortex_route_decision_seconds", "time to route one request inside extproc",
                             buckets=_BUCKETS)
STAGE_SECONDS = Histogram("cortex_route_stage_seconds", "time per routing stage", ["stage"], buckets=_BUCKETS)
PD_DECISIONS = Counter("cortex_pd_decisions", "requests of PD-served models by outcome: pair, pair_repicked, "
                       "skipped:<why>, fallback:<why>", ["engine", "outcome"])
PD_FAILURES = Counter("cortex_pd_failures", "PD leg failures (dispatch, HTTP status class, watchdog = bootstrap "
                      "timeout, decode_failed ...)", ["engine", "leg", "event"])
PD_LEG_SECONDS = Histogram("cortex_pd_leg_seconds", "PD transfer path: prefill leg dispatch to its answer",
                           ["engine", "leg"], buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                                                       5.0, 10.0, 30.0))

# Tenancy and overload (docs/tenancy.md). Reasons are a fixed set: unauthenticated, rate_limited, concurrency,
# tokens_per_minute, token_quota, queue_full, queue_ttl; tenants are bounded by the config.
ADMISSION_REJECTIONS = Counter("cortex_admission_rejections", "requests refused before reaching a worker, by reason",
                               ["tenant", "reason"])
ADMITTED = Counter("cortex_admitted_requests", "requests admitted, by tenant", ["tenant"])
# The waiting room (extproc/waiting_room.py), per priority band; every extproc process holds its own room, and
# "livesum" adds the rooms of the processes that are alive.
QUEUE_DEPTH = Gauge("cortex_queue_depth", "requests in the waiting room, by priority band", ["band"],
                    multiprocess_mode="livesum")
QUEUE_WAIT_SECONDS = Histogram("cortex_queue_wait_seconds", "time a request spent in the waiting room before it "
                               "was released or expired, by priority band", ["band"],
                               buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0))

# A restart shows as a new value (the supervisor restarts a dead process under the same index): "max" keeps the
# newest start of each index across the per-process files, whose dead predecessors' files stay behind.
START_TIME = Gauge("cortex_extproc_start_time_seconds", "unix time the extproc process of this index started",
                   ["process"], multiprocess_mode="max")

# Per-worker circuit breakers (extproc/breaker.py): each extproc process keeps its own, and the gauge shows the worst
# over the live processes. Workers are bounded by ingest.max_workers.
BREAKER_STATE = Gauge("cortex_breaker_state", "circuit breaker per worker: 0 closed, 1 half-open, 2 open "
                      "(the worst over extproc processes)", ["worker"], multiprocess_mode="livemax")
BREAKER_TRANSITIONS = Counter("cortex_breaker_transitions", "circuit breaker transitions per worker",
                              ["worker", "from_state", "to_state"])


# The key chain cache (cortex/chain_cache.py), one per tokenizer in use, summed over them: its counts are integers
# on the routing thread, handed over by report_chain_caches from the upkeep loop (no metric write per decision).
CHAIN_LOOKUPS = Counter("cortex_chain_cache_lookups", "prompts looked up in the key chain cache: hit (the walk "
                        "started at a cached boundary) or miss", ["outcome"])
CHAIN_STORES = Counter("cortex_chain_cache_stores", "key chains cached at a boundary (stored), or not cached because "
                       "one entry would take over an eighth of the cache (skipped_too_large)", ["outcome"])
CHAIN_EVICTIONS = Counter("cortex_chain_cache_evictions", "key chains dropped to keep the cache within its entries "
                          "and bytes")
CHAIN_ENTRIES = Gauge("cortex_chain_cache_entries", "key chains held (all extproc processes)",
                      multiprocess_mode="livesum")
CHAIN_BYTES = Gauge("cortex_chain_cache_bytes", "estimated bytes the key chains held take (all extproc processes)",
                    multiprocess_mode="livesum")
_CHAIN_SERIES = (CHAIN_LOOKUPS.labels("hit"), CHAIN_LOOKUPS.labels("miss"), CHAIN_STORES.labels("stored"),
                 CHAIN_STORES.labels("skipped_too_large"), CHAIN_EVICTIONS)


def report_chain_caches(caches: Iterable[ChainCache]) -> None:
    """What the caches counted since they were last reported, and what they hold now. A cache dropped on a
    reload takes its last upkeep period's counts with it."""
    entries = held = 0
    for cache in caches:
        for series, n in zip(_CHAIN_SERIES, cache.unreported(), strict=True):
            if n:
                series.inc(n)
        entries += len(cache)
        held += cache.bytes
    CHAIN_ENTRIES.set(entries)
    CHAIN_BYTES.set(held)


_BREAKERS_SHOWN: set[str] = set()


def breakers_known(workers: Iterable[str]) -> None:
    """A closed breaker is a 0 from the start, not a missing series, and so are its two ways of opening: a panel
    sees every worker, and the first opening is an increase of the transitions counter (a counter's first
    scraped value is never in a rate: an alert counting openings would miss the first)."""
    for worker in workers:
        if worker not in _BREAKERS_SHOWN:
            _BREAKERS_SHOWN.add(worker)
            BREAKER_STATE.labels(worker)
            for before in (State.CLOSED, State.HALF_OPEN):
                BREAKER_TRANSITIONS.labels(worker, before.value, State.OPEN.value)


def breaker_transition(worker: str, old: State, new: State) -> None:
    BREAKER_STATE.labels(worker).set(LEVEL[new])
    BREAKER_TRANSITIONS.labels(worker, old.value, new.value).inc()


def observe_decision(result: RoutePlan, total_s: float, block_size: int) -> None:
    d = result.decision
    model = result.model
    DECISIONS.labels(model, d.mode, d.reason).inc()
    HIT_TOKENS.labels(model).inc(d.hit_tokens)
    if d.order:
        chosen = d.chosen
        claimed = d.hit_tokens > 0
        left = chosen.tier_claimed if claimed else 0
        for medium, n in chosen.tier_media:  # in load order: the claimed part comes first
            took = min(n, left)
            left -= took
            if took:
                LOWER_TIER_TOKENS.labels(medium, "true").inc(took * block_size)
            if n - took:
                LOWER_TIER_TOKENS.labels(medium, "false").inc((n - took) * block_size)
        WINDOW_WITHHELD_TOKENS.inc(result.withheld.get(chosen.slot, 0) * block_size)
    if d.order:
        # What round robin (or any choice blind to the cache) would have got on average, proven blocks only.
        RANDOM_HIT_TOKENS.labels(model).inc(sum(c.matched_blocks for c in d.order) * block_size / len(d.order))
    PROMPT_TOKENS.labels(model).inc(result.prompt_tokens)
    DECISION_SECONDS.observe(total_s)
    for stage in ("tokenize", "hash", "lookup", "score"):
        STAGE_SECONDS.labels(stage).observe(getattr(result.timings, f"{stage}_s"))


def gc_pauses(pauses: Iterable[tuple[int, float]]) -> None:
    """The collections since the last call (`cortex.gc_pauses.Pauses.drain`), taken outside the collector."""
    for generation, seconds in pauses:
        GC_PAUSE_SECONDS.labels(str(generation)).observe(seconds)
