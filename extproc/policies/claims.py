"""What a decision may claim: a proven hit, unless the engine will likely have evicted it by the time it runs.

A claim (`x-cortex-cache-hit-tokens`, mode `exact_kv_events`) promises the client that the engine serves those
tokens from its cache. The ledger proves the blocks are held at the decision; it cannot prove they still are
when the engine schedules the request. On a pool nearly full, other requests' allocations meanwhile evict the
least recently used free blocks, which is what a waiting request's prefix is (docs/reliability.md, "Claims
under cache pressure"). Where that is likely (`at_risk`) the claim is withheld: the worker is still the one
chosen (its blocks may well survive, and nothing else holds them), the mode is `load_aware`, the reason
`claim_withheld_kv_pressure`, and nothing is claimed. Every load-reading policy applies it last (tiers.py,
p2c.py).
"""

from __future__ import annotations

from dataclasses import replace

from extproc.policies.base import EXACT, LOAD_AWARE, Candidate, Decision, Facts, queue_ms

KV_PRESSURE = "claim_withheld_kv_pressure"


def evicted_before_admission(c: Candidate, facts: Facts, typical_ms: float) -> float | None:
    """Tokens `c`'s engine will have evicted between this replica's last send of the matched prefix and the
    request's admission: those counted since (the ledger's BlockRemoved, as last read), those since that reading
    at the recent rate, and one per token of the prefill queued ahead (its blocks are allocated when each request
    ahead is admitted, and in a warm pool each allocation evicts; this also covers the step running now, whose
    BlockRemoved the engine publishes only when it ends). A prefix this replica never sent there is taken as
    `claim_unknown_age_s` old at the recent rate. None: the engine's evictions are not known."""
    rate, s = c.evicted_tokens_per_s, facts.scoring
    if rate is None:
        return None
    ahead = queue_ms(c, typical_ms) / s.alpha_ms_per_token if s.alpha_ms_per_token > 0 else 0.0
    if c.last_sent is None:
        return rate * s.claim_unknown_age_s + ahead
    return c.last_sent.evicted_tokens + rate * c.uncounted_s + ahead


def too_old(c: Candidate, facts: Facts, typical_ms: float) -> bool:
    """Whether the engine's LRU will likely have reached the matched prefix by the time it admits the request.
    Each allocation evicts the least recently freed block whether or not the pool overflows; when the prefix was
    last freed, the pool's free part stood in front of it. So it is gone once the evictions since reach that
    free part: claimed only while they stay under `claim_horizon_share` of it (the free part now stands in for
    the one then)."""
    evicted = evicted_before_admission(c, facts, typical_ms)
    if not evicted or c.kv_usage is None or c.kv_capacity_tokens is None:
        return False
    free = max(0.0, 1.0 - c.kv_usage) * c.kv_capacity_tokens
    return evicted > facts.scoring.claim_horizon_share * free


def at_risk(c: Candidate, facts: Facts) -> bool:
    """Whether the engine will likely have evicted part of a hit on `c` before it runs the request. With the
    pool's size known: when the request does not fit beside what is pinned now and what is queued ahead of it,
    i.e. the pool's held part, the new blocks of the work ahead (its prefill time at the configured rate, an
    overestimate) and the whole prompt exceed the pool. Then the engine makes room by evicting the least
    recently freed blocks, or the request waits while others' allocations do; vLLM and SGLang free a finished
    request's blocks tail first, so a conversation's prefix goes tail first. Without the size: when the pool is
    at least `claim_max_kv_usage` held. And on a pool that is evicting, when the engine's LRU will likely have
    reached the prefix (`too_old`): its BlockRemoved for a block it evicts while scheduling reach the ledger only
    after that step ran, so the ledger alone cannot tell."""
    usage = c.kv_usage
    if usage is None:
        return False
    s = facts.scoring
    if usage >= s.claim_max_kv_usage:
        return True
    typical = facts.typical_prefill_ms if facts.typical_prefill_ms is not None else s.queued_request_ms
    if too_old(c, facts, typical):
        return True
    if c.kv_capacity_tokens is None or s.alpha_ms_per_token <= 0:
        return False
    ahead = queue_ms(c, typical) / s.alpha_ms_per_token
    return usage * c.kv_capacity_tokens + ahead + facts.prompt_tokens > c.kv_capacity_tokens


def withheld(d: Decision, facts: Facts) -> Decision:
    """`d`, with its claim withheld when its chosen worker's pool will likely have evicted part of it (`at_risk`)."""
    if d.mode != EXACT or not at_risk(d.chosen, facts):
        return d
    return replace(d, mode=LOAD_AWARE, reason=KV_PRESSURE, hit_tokens=0)
