"""Routing candidates, built in one place from the targets, the ledger's matches and Cortex's own counts.

Every decision's candidates come from `build`: an inference request's (its model's pool, with cache facts) and
a request that is no inference (`whole_workers`: any worker of the fleet). What a policy may use is decided
here: a worker whose ledger ingest does not vouch for (`exact_kv` false) gets no matched or predicted blocks,
whatever the view says, so no policy can claim or follow a hit it cannot prove.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from cortex.config import SchedulerConfig
from extproc.cluster_view import TargetInfo
from extproc.engine_hits import LowerHit
from extproc.policies.base import Candidate, still_hot, work_ahead_ms
from extproc.predictions import Predictions


class Hysteresis:
    """Each target's hot flags, carried from one committed decision to the next (the watermarks' hysteresis): by
    requests (high/low_watermark) and, under the time model, by predicted prefill queue (high/low_queue_ms).
    `build` only reads them; the router carries a committed plan's candidates' flags (`carry`), so route explain,
    which commits nothing, leaves them as they were."""

    def __init__(self) -> None:
        self._hot: dict[int, bool] = {}
        self._queue_hot: dict[int, bool] = {}

    def hot(self, slot: int, active: float, s: SchedulerConfig) -> bool:
        return still_hot(self._hot.get(slot, False), active, s)

    def queue_hot(self, slot: int, queue_ms: float, s: SchedulerConfig) -> bool:
        if self._queue_hot.get(slot, False):
            return queue_ms > s.low_queue_ms
        return queue_ms >= s.high_queue_ms

    def carry(self, cands: Iterable[Candidate]) -> None:
        for c in cands:
            self._hot[c.slot] = c.hot_requests
            if c.hot_queue is not None:
                self._queue_hot[c.slot] = c.hot_queue


def build(workers: Sequence[TargetInfo], *, matches: np.ndarray | None, keys: Sequence[int], inflight: np.ndarray,
          alive: bool, predictions: Predictions, hysteresis: Hysteresis, scoring: SchedulerConfig,
          backlog_ms: np.ndarray | None = None, calibration: Mapping[str, float] | None = None,
          typical_prefill_ms: float | None = None, lower: Mapping[int, LowerHit] | None = None) -> list[Candidate]:
    """An inference request's candidates. `matches`: leading blocks each slot's engine reuses from its GPU (None:
    the ledger did not answer); `lower`: per slot, the run a lower tier holds after that (extproc/engine_hits.py);
    `inflight`: Cortex's in-flight totals per slot; `alive`: ingest's view is live (else engine load is not
    trusted); `backlog_ms`: this replica's prefill work per slot not done yet; `calibration`: observed over
    predicted TTFT per worker id. Under `scheduler.rule: ttft` a worker is hot by its predicted queue too.
    Nothing is written: the hot flags read from `hysteresis` stay there until the caller carries them
    (Hysteresis.carry)."""
    by_work = scoring.rule == "ttft"
    typical = typical_prefill_ms if typical_prefill_ms is not None else scoring.queued_request_ms
    live = [w for w in workers if w.healthy]
    now = time.monotonic()
    # What one of this replica's in-flight requests still has to prefill, on average: the price of each active
    # request the engine reports beyond them (other replicas', other clients'), assumed alike. With nothing of
    # its own in flight there is no evidence of the mix (most active requests decode): none is priced, and the
    # engine's waiting count still prices the queued ones (ttft.queue_ms).
    own = sum(int(inflight[w.slot]) for w in live)
    left = sum(float(backlog_ms[w.slot]) for w in live) / own if backlog_ms is not None and own else 0.0
    cands = []
    for w in live:
        trusted = matches is not None and w.exact_kv
        matched = int(matches[w.slot]) if trusted and matches is not None else 0
        tier = lower.get(w.slot) if trusted and lower else None
        sent = predictions.last_sent(w.slot, keys[matched - 1]) if 0 < matched <= len(keys) else None
        n_inflight = int(inflight[w.slot])
        engine_load, waiting = w.load_now(n_inflight, alive)
        active = max(engine_load or 0.0, float(n_inflight))
        backlog = float(backlog_ms[w.slot]) if backlog_ms is not None else 0.0
        foreign = max(0.0, (engine_load or 0.0) - n_inflight) * left
        by_requests = hysteresis.hot(w.slot, active, scoring)
        # Both flags are carried every decision, so neither loses its hysteresis while the other is set. Decided
        # before the candidate is built: one built and then copied with the flag (dataclasses.replace) cost more
        # than the rest of the decision at 256 workers.
        by_queue = hysteresis.queue_hot(w.slot, work_ahead_ms(backlog, foreign, waiting, typical), scoring) \
            if by_work else None
        cands.append(Candidate(
            id=w.id, slot=w.slot, address=w.address, ledger_trusted=trusted,
            matched_blocks=matched + (tier.claimed if tier else 0),
            tier_blocks=tier.blocks if tier else 0, tier_claimed=tier.claimed if tier else 0,
            tier_credit=tier.credit if tier else 0.0, tier_media=tuple(tier.by_medium.items()) if tier else (),
            predicted_blocks=predictions.extend(keys, w.slot, matched) if trusted else 0,
            engine_load=engine_load, engine_waiting=waiting, inflight=n_inflight,
            hot=by_requests or bool(by_queue), hot_requests=by_requests, hot_queue=by_queue, rank=w.rank,
            engine=w.engine, suspect=w.suspect, new=w.added_at is not None and now - w.added_at < scoring.cold_start_s,
            backlog_ms=backlog, foreign_ms=foreign,
            calibration=calibration.get(w.worker, 1.0) if calibration else 1.0,
            kv_usage=w.kv_usage if engine_load is not None else None, kv_capacity_tokens=w.kv_capacity_tokens,
            evicted_tokens_per_s=w.evicted_tokens_per_s if engine_load is not None else None,
            last_sent=sent, uncounted_s=max(0.0, now - w.load_at) if w.load_at else 0.0,
            regret_share=regret_share(w.evicted_tokens_per_s, w.regretted_tokens_per_s),
        ))
    return cands


def regret_share(evicted_per_s: float | None, regretted_per_s: float | None) -> float:
    """The share of a worker's recent evictions that came back (0 when it is not evicting), at most 1."""
    if not evicted_per_s or not regretted_per_s or evicted_per_s <= 0:
        return 0.0
    return min(1.0, max(0.0, regretted_per_s / evicted_per_s))


def whole_workers(targets: Sequence[TargetInfo], *, inflight: np.ndarray, alive: bool) -> list[Candidate]:
    """A request that is no inference (any worker will do): one candidate per worker, by its id and without a
    rank, so the worker's own DP balancing places it. No cache facts, and neither the hot nor the cold-start
    guard: they protect cache affinity and warm-up, which such a request has nothing to do with."""
    return [Candidate(id=t.worker, slot=t.slot, address=t.address, inflight=int(inflight[t.slot]), suspect=t.suspect,
                      engine_load=t.load_now(int(inflight[t.slot]), alive)[0])
            for t in targets if t.healthy and t.rank in (None, 0)]


def why_not_exact(why: str, workers: Sequence[TargetInfo], matches: np.ndarray | None,
                  cands: Sequence[Candidate]) -> str:
    """The reason code when no proven hit decides, refined by what the ledger says about untrusted workers."""
    if matches is None:
        return why
    # The prompt's blocks may sit on a target whose ledger is not trusted right now: say why.
    untrusted = [(int(matches[w.slot]), w.why) for w in workers if not w.exact_kv and matches[w.slot] > 0]
    if untrusted:
        return max(untrusted)[1]
    if not any(c.ledger_trusted for c in cands):
        return "no_worker_ledger_ready"
    if any(w.why == "ledger_stale" for w in workers):
        # A STALE target is hidden in the view until its stream is back in sync (docs/ledger.md, "Windows"),
        # so whether it holds this prompt is unknown: say that, not "nothing cached".
        return "ledger_stale"
    return why
