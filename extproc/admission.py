"""Admission: whether a tenant's request may go on, by its limits, before it reaches a worker (docs/tenancy.md).

Two checks, each where its inputs first exist: the request rate and the concurrency at the request headers (no
body needed, so a refused client costs Cortex nothing more), the token limits once the request is routed (the
prompt's length and the hit Cortex can prove are known then: cached tokens are charged at their own weight). A
request holds a `Ticket` from admission to its end; `release` runs in every ending (success, client gone,
upstream error, timeout) from the ext_proc stream's `finally`, and an extproc restart releases all its tickets
(cortex/tenancy/board.py). A tenant without limits never touches the board.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from cortex.config import CortexConfig
from cortex.errors import ClientError
from cortex.tenancy import limits
from cortex.tenancy.board import INFLIGHT, RESERVED, TenancyBoard
from extproc import metrics
from extproc.tenants import Tenant


@dataclass(slots=True)
class Ticket:
    tenant: Tenant
    slot: int
    """Its tenant's row on the board (-1: an unlimited tenant, nothing held)."""
    counted: bool = False
    reserved: int = 0
    """Tokens reserved (whole tokens, so releases return the counters exactly to zero)."""
    released: bool = False


def refusal(tenant: str, reason: str, status: int, message: str, retry_after_s: float) -> ClientError:
    """A 429/503 that says why, how long to wait, and under which dropped reason (Cortex's and llm-d's names)."""
    metrics.ADMISSION_REJECTIONS.labels(tenant, reason).inc()
    return ClientError(status, message, headers={"retry-after": str(max(1, math.ceil(retry_after_s)))}, reason=reason)


class Admission:
    def __init__(self, cfg: CortexConfig, board: TenancyBoard, clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self.board = board
        self.clock = clock

    def admit(self, tenant: Tenant) -> Ticket:
        """Take one request of `tenant` in, or raise its 429 (rate_limited, concurrency)."""
        lim = tenant.limits
        metrics.ADMITTED.labels(tenant.id).inc()
        if lim.requests_per_s is None and lim.max_concurrent is None and lim.tokens_per_minute is None \
                and lim.token_quota is None:
            return Ticket(tenant, -1)
        slot = self.board.slot(tenant.id)
        ticket = Ticket(tenant, slot)
        if lim.requests_per_s is None and lim.max_concurrent is None:
            return ticket
        board = self.board
        with board.locked():
            now = self.clock()
            tat = board.rate[slot]
            if lim.requests_per_s is not None:
                verdict, tat = limits.gcra(tat, now, lim.requests_per_s, limits.burst_of(lim.requests_per_s,
                                                                                          lim.burst))
                if not verdict.allowed:
                    raise refusal(tenant.id, "rate_limited", 429, f"Rate limit reached for tenant {tenant.id}: "
                                  f"{lim.requests_per_s:g} requests per second.", verdict.retry_after_s)
            if lim.max_concurrent is not None and board.held_total(slot)[INFLIGHT] >= lim.max_concurrent:
                raise refusal(tenant.id, "concurrency", 429, f"Tenant {tenant.id} already has "
                              f"{lim.max_concurrent} requests in flight.", 1.0)
            board.rate[slot] = tat
            board.held[slot, INFLIGHT] += 1
        ticket.counted = True
        return ticket

    def reserve(self, ticket: Ticket, prompt_tokens: int, hit_tokens: int, completion_tokens: int) -> None:
        """Reserve what the routed request may cost, or raise its 429 (tokens_per_minute, token_quota)."""
        lim = ticket.tenant.limits
        if ticket.slot < 0 or (lim.tokens_per_minute is None and lim.token_quota is None):
            return
        amount = math.ceil(limits.cost(self.cfg.admission.charge, prompt_tokens, hit_tokens, completion_tokens))
        board, slot, tenant = self.board, ticket.slot, ticket.tenant.id
        with board.locked():
            now = self.clock()
            minute, quota = limits.window(now, 60), limits.window(now, lim.quota_period_s)
            in_minute, in_quota = board.charged(slot, minute, quota)
            reserved = float(board.held_total(slot)[RESERVED])
            if not limits.fits(lim.tokens_per_minute, in_minute, reserved, amount):
                too_big = lim.tokens_per_minute is not None and amount > lim.tokens_per_minute
                raise refusal(tenant, "tokens_per_minute", 429, (
                    f"Request too large for tenant {tenant}: it may cost {amount} tokens (prompt and max_tokens) "
                    f"and the limit is {lim.tokens_per_minute} per minute; lower max_tokens." if too_big else
                    f"Token rate limit reached for tenant {tenant}: {lim.tokens_per_minute} tokens per minute."),
                    limits.window_left_s(now, 60))
            if not limits.fits(lim.token_quota, in_quota, reserved, amount):
                raise refusal(tenant, "token_quota", 429, f"Token quota of tenant {tenant} is used up for this "
                              f"period ({lim.token_quota} tokens per {lim.quota_period_s} s).",
                              limits.window_left_s(now, lim.quota_period_s))
            board.held[slot, RESERVED] += amount
        ticket.reserved = amount

    def release(self, ticket: Ticket | None) -> None:
        """The request ended, however it ended (idempotent). Without an observer to settle it with the engine's
        usage, the reservation itself is charged."""
        if ticket is None or ticket.released:
            return
        ticket.released = True
        slot = ticket.slot
        if ticket.counted:
            self.board.held[slot, INFLIGHT] -= 1
        if ticket.reserved:
            self.board.held[slot, RESERVED] -= ticket.reserved
            if not self.cfg.observe.enabled:
                now = self.clock()
                self.board.charge(slot, ticket.reserved, limits.window(now, 60),
                                  limits.window(now, ticket.tenant.limits.quota_period_s))
