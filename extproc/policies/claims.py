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


def at_risk(c: Candidate, facts: Facts) -> bool:
    """Whether the engine will likely have evicted part of a hit on `c` before it runs the request. With the
    pool's size known: when the request does not fit beside what is pinned now and what is queued ahead of it,
    i.e. the pool's held part, the new blocks of the work ahead (its prefill time at the configured rate, an
    overestimate) and the whole prompt exceed the pool. Then the engine makes room by evicting the least
    recently freed blocks, or the request waits while others' allocations do; vLLM and SGLang free a finished
    request's blocks tail first, so a conversation's prefix goes tail first. Without the size: when the pool is
    at least `claim_max_kv_usage` held."""
    usage = c.kv_usage
    if usage is None:
        return False
    s = facts.scoring
    if usage >= s.claim_max_kv_usage:
        return True
    if c.kv_capacity_tokens is None or s.alpha_ms_per_token <= 0:
        return False
    typical = facts.typical_prefill_ms if facts.typical_prefill_ms is not None else s.queued_request_ms
    ahead = queue_ms(c, typical) / s.alpha_ms_per_token
    return usage * c.kv_capacity_tokens + ahead + facts.prompt_tokens > c.kv_capacity_tokens


def withheld(d: Decision, facts: Facts) -> Decision:
    """`d`, with its claim withheld when its chosen worker's pool will likely have evicted part of it (`at_risk`)."""
    if d.mode != EXACT or not at_risk(d.chosen, facts):
        return d
    return replace(d, mode=LOAD_AWARE, reason=KV_PRESSURE, hit_tokens=0)
