"""Per-source sequence checks: what a batch's sequence number says about the stream (pure, no I/O).

Engines number batches from 0 in each publisher process (itertools.count()), one source per worker and
data-parallel rank. So: the next number is expected; an older one is a duplicate, unless it is a fresh
start from 0 (the publisher restarted); a jump ahead means batches were lost (ZMQ drops silently past the
high-water mark, and a new subscription misses what was sent before it joined).
"""

from __future__ import annotations

from enum import Enum


class SeqVerdict(Enum):
    FIRST = "first"          # nothing seen yet from this source
    NEXT = "next"            # exactly last + 1
    DUPLICATE = "duplicate"  # already applied: drop
    GAP = "gap"              # batches missing between last and this one
    RESTART = "restart"      # the publisher restarted: everything known about the worker is void


def classify(last_seq: int | None, seq: int) -> SeqVerdict:
    if last_seq is None:
        return SeqVerdict.FIRST
    if seq == last_seq + 1:
        return SeqVerdict.NEXT
    if seq > last_seq + 1:
        return SeqVerdict.GAP
    if seq == 0 and last_seq > 0:
        return SeqVerdict.RESTART
    return SeqVerdict.DUPLICATE
