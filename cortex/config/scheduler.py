"""How a worker is chosen for a request: the scheduler's time model and guards, and session affinity."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from cortex.config.base import Strict


class SchedulerConfig(Strict):
    """How a worker is chosen (docs/scheduling.md). `rule: ttft` (the default) predicts each candidate's time to
    first token from the work queued there and the tokens it would still compute, and picks the smallest;
    `rule: cache_aware` is the older score, alpha * matched_tokens - beta * active - gamma * queue_latency.
    Both keep the guards against piling onto one GPU."""

    rule: Literal["ttft", "cache_aware"] = "ttft"
    """`ttft`: the time model (extproc/policies/ttft.py). `cache_aware`: the request-counting score
    (extproc/policies/cache_aware.py), kept for comparison."""
    alpha_ms_per_token: float = Field(0.045, ge=0)
    """Prefill time per uncached prompt token, the linear (weight-bound) part: 0.045 ms is ~22K tokens/s, an 8B
    model in bf16 on one H100 (2 x 8e9 FLOP per token at 36 % of 989 TFLOPS; docs/simulator.md's sources).
    Raise it for bigger models, whose prefill is slower per token. The time model starts from it and learns each
    worker's own rate from observed TTFTs (`calibrate`)."""
    attention_ms_per_token2: float = Field(1.06e-6, ge=0)
    """The attention part of prefill, which grows with context: computing u tokens after c cached ones costs
    this x u x (c + u / 2) ms. 1.06e-6 is an 8B GQA model on one H100 (4 x 32 layers x 4096 FLOP per query-key
    pair at 50 %): attention outweighs the linear part from ~85K-token prompts on."""
    step_ms: float = Field(6.2, ge=0)
    """The fixed cost of one engine step (reading the 16 GB of weights once at 77 % of 3.35 TB/s), paid once per
    chunk of `step_tokens`."""
    step_tokens: int = Field(8192, ge=1)
    """Prompt tokens one engine step computes at most (vLLM max_num_batched_tokens, SGLang chunked_prefill_size):
    a longer prompt is prefilled over several steps."""
    running_ms_per_request: float = Field(0.1, ge=0)
    """What each running request adds to every step a prefill shares with it (decode interference: its decode
    token and the read of its KV, ~0.05 ms per 1K tokens of context)."""
    work_weight: float = Field(0.25, ge=0)
    """The time model's price of fleet capacity: a candidate's score is its predicted TTFT plus this share of the
    prefill work it would spend, so between equal TTFTs the worker that recomputes less wins (a burst stays
    together, a cold copy elsewhere is not started for nothing)."""
    eviction_weight: float = Field(1.0, ge=0)
    """The time model's price of what a request evicts: on a worker whose pool is evicting, the new blocks a
    request brings evict as many tokens there, and the share of them that will be needed again (the worker's
    regretted over evicted tokens, ingest/regret.py) will be prefilled again. The score adds this weight times
    that share of the request's own prefill there. 0: evictions are free."""
    high_queue_ms: float = Field(8000.0, gt=0)
    """Predicted prefill queue (ms) at which a worker stops receiving cache-affinity traffic under `rule: ttft`:
    the watermark in work, beside the request-count one."""
    low_queue_ms: float = Field(4000.0, ge=0)
    """It receives affinity traffic again once its queue is back at or under this (hysteresis)."""
    claim_max_kv_usage: float = Field(0.9, gt=0, le=1)
    """A proven hit on a worker whose pool is at least this full (held by running requests, as the engine
    reports it) is not claimed: other requests' allocations can evict it before the engine schedules this one
    (docs/reliability.md, "Claims under cache pressure"). It still decides where the request goes. 1: always
    claim."""
    claim_horizon_share: float = Field(0.5, gt=0, le=1)
    """On a worker whose engine is evicting, a proven hit is claimed only while the tokens evicted there since
    this replica last sent the prefix, plus those expected until the engine admits the request, stay under this
    share of the pool's free part: when the prefix was freed that free part stood in front of it in the engine's
    LRU (docs/scheduling.md, "Claims that hold at scheduling time"). The free part then is taken as the free part
    now, which bursts of admissions make uncertain. 1: up to the whole free part."""
    claim_unknown_age_s: float = Field(30.0, ge=0)
    """For the rule above, a matched prefix this replica has not sent to the worker itself (another replica's or
    client's traffic put it there) is taken as this old, its evictions at the worker's recent rate."""
    calibrate: bool = True
    """Scale each worker's predictions by what its observed TTFTs say (`cortex observe` learns the ratio of
    observed to predicted per worker): a slow worker learns its own rate."""
    beta_ms_per_active: float = Field(5.0, ge=0)
    """`rule: cache_aware`: what one more running request on a worker costs a newcomer (batch contention in decode
    and chunked prefill)."""
    gamma: float = Field(1.0, ge=0)
    """`rule: cache_aware`: weight of the queueing delay (waiting requests x queued_request_ms)."""
    queued_request_ms: float = Field(100.0, ge=0)
    """How long one queued request holds the line (about one average prefill). Under `rule: ttft` only until the
    first request was routed: from then on the typical prefill of the requests routed stands in."""
    high_watermark: float = Field(48.0, gt=0)
    """Active requests (running + waiting, or Cortex's in-flight count if larger) at which a worker stops
    receiving cache-affinity traffic."""
    low_watermark: float = Field(32.0, ge=0)
    """It receives affinity traffic again once back at or under this (hysteresis)."""
    near_min_window: float = Field(2.0, ge=0)
    """A cache holder within this many active requests of the least-loaded worker is preferred outright."""
    cold_start_s: float = Field(300.0, ge=0)
    """A worker added less than this long ago counts as new (its cache starts empty)."""
    cold_start_share: float = Field(0.1, ge=0, le=1)
    """Share of the requests that no worker can serve from cache that go to a new worker, so it warms up."""
    replicas: int = Field(1, ge=1)
    """Gateway replicas routing over this fleet independently (each with its own view of its own traffic): set it
    to their count. With more than one, replicas deciding at the same instant see the same engines and would all
    pick the same fastest worker; each prompt then goes, among the `replicas` fastest candidates that hold as much
    of it as the best and score within `replica_band` typical prefills of it, to its home (the rendezvous hash
    below), so different prompts spread while identical ones still meet (docs/scheduling.md, "Several
    replicas")."""
    replica_band: float = Field(1.0, ge=0)
    """With `replicas` > 1: how far behind the best a candidate may score, in typical prefills of the requests
    routed (what one collision with another replica's pick costs), and still take a prompt whose home it is.
    0: always the best, as with one replica."""
    prompt_home: bool = True
    """A prompt no worker holds goes, among the least loaded workers, to its home (a hash of its first block past
    the longest prefix any worker holds, the same on every replica), so replicas agree and repeats land together
    before any event arrives, while prompts that share only a system prompt spread. Off: a random least-loaded
    worker (pure load balancing for prompts nobody holds)."""
    tier_weights: dict[Literal["CPU", "STORAGE"], Annotated[float, Field(ge=0, le=1)]] = Field(
        default_factory=lambda: {"CPU": 0.75, "STORAGE": 0.25})  # type: ignore[arg-type]
    """What a block a worker holds on a lower tier (its engine offloaded it: vLLM's OffloadingConnector, LMCache,
    SGLang HiCache) is worth in the score, against 1 for a block on its GPU: such a block is loaded instead of
    computed, which saves most of its prefill but not the transfer. Dynamo's defaults (CPU 0.75, disk 0.25;
    llm-d weighs CPU 0.8 and has no disk weight); docs/ledger.md, "Tiers". A tier left out counts 0. A
    lower-tier hit is claimed only where the engine reports it in cached_tokens (vLLM does)."""

    @model_validator(mode="after")
    def _watermarks(self) -> SchedulerConfig:
        if self.low_watermark >= self.high_watermark:
            raise ValueError(f"low_watermark ({self.low_watermark}) must be below high_watermark "
                             f"({self.high_watermark})")
        if self.low_queue_ms >= self.high_queue_ms:
            raise ValueError(f"low_queue_ms ({self.low_queue_ms}) must be below high_queue_ms "
                             f"({self.high_queue_ms})")
        return self


class SessionConfig(Strict):
    """Session affinity: requests naming the same session key stay on one worker and one canary target."""

    headers: list[str] = Field(default_factory=lambda: ["x-smg-routing-key", "x-session-id"])
    """Request headers read, in order, for the session key (the first one present and not blank wins; names are
    case-insensitive). A key longer than 256 bytes is replaced by its digest. Empty: no session affinity and no
    per-session canary draw (docs/tenancy/sessions.md)."""

    @field_validator("headers")
    @classmethod
    def _lowercase(cls, value: list[str]) -> list[str]:
        # Envoy hands extproc lowercase header names (HTTP/2 rules), so the names are compared lowercased.
        names = [v.strip().lower() for v in value]
        if any(not n or n.startswith(":") for n in names):
            raise ValueError("session.headers: a header name must be non-empty and not a pseudo-header")
        return names
