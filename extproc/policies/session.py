"""Session affinity: requests naming one session key stay on one worker (docs/tenancy/sessions.md).

The session's worker is the candidate with the highest rendezvous weight for the key among the *eligible*
candidates: the leading standing tier (good standing while one exists, as tiers.py) minus the hot ones (over
the high watermark, hysteresis down to the low one). The rule, applied to the decision a policy made without it:

  1. no session key, or no eligible candidate: the policy's decision;
  2. a proven hit elsewhere larger than the session worker's: the policy's decision (affinity never overrides a
     proven larger hit; an eligible candidate's proven blocks only: a hot worker gets no affinity traffic anyway,
     and predictions are not proof);
  3. otherwise the session worker goes first, the policy's order behind it as retry targets. Its proven blocks
     (if any) are claimed as the hit, exactly as cache_aware.py would claim them; the reason is
     `session_affinity` unless the policy had chosen that worker anyway (then its own reason stands).

A pure function of the key and the candidates, so every replica and every extproc process sends a session to the
same worker; a worker joining or leaving moves only the sessions whose worker it becomes or was, and a hot
worker's sessions go to their second choice until it has cooled (then they return, unless the second choice
meanwhile proves a larger hit: their conversation's blocks, so they stay).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import xxhash

from extproc.policies.base import EXACT, LOAD_AWARE, Candidate, Decision, Facts

REASON = "session_affinity"
MAX_KEY_BYTES = 256
"""A longer key is replaced by its digest (`key_of`): any key works, and a stream never holds more than this."""


def key_of(value: str | None) -> str | None:
    """A header value as a session key: None when absent or blank; longer than MAX_KEY_BYTES (UTF-8): its
    XXH3-128 digest, so long keys keep working (equal keys, equal digests) at a bounded cost."""
    if value is None:
        return None
    value = value.strip()
    if not value:
        return None
    raw = value.encode("utf-8", "surrogatepass")
    if len(raw) > MAX_KEY_BYTES:
        return "xxh3-128:" + xxhash.xxh3_128_hexdigest(raw)
    return value


def key_hash(key: str) -> int:
    """The session key as Facts.session: a stable 64-bit hash (Python's hash() differs per process)."""
    return xxhash.xxh3_64_intdigest(key.encode("utf-8", "surrogatepass"))


def weight(session: int, target: str) -> int:
    """Highest-random-weight hashing: `target`'s weight for the session (the same on every replica)."""
    return xxhash.xxh3_64_intdigest(target.encode(), seed=session)


def eligible(cands: Sequence[Candidate]) -> list[Candidate]:
    """The candidates a session may be kept on: healthy (every candidate is), in the leading standing tier, cool."""
    tier = [c for c in cands if not c.suspect] or list(cands)
    return [c for c in tier if not c.hot]


def home(cands: Sequence[Candidate], session: int) -> Candidate | None:
    """The session's worker (None: every candidate of the leading tier is hot)."""
    pool = eligible(cands)
    if not pool:
        return None
    return max(pool, key=lambda c: weight(session, c.id))


def stick(d: Decision, cands: Sequence[Candidate], facts: Facts) -> Decision:
    """The decision with session affinity applied (the module's rule); `d` is the policy's own over `cands`."""
    if facts.session is None or not cands:
        return d
    pool = eligible(cands)
    if not pool:
        return d
    own = max(pool, key=lambda c: weight(facts.session or 0, c.id))
    if d.chosen.id == own.id:
        return d
    proven_here = own.matched_blocks if own.ledger_trusted else 0
    if any(c.ledger_trusted and c.matched_blocks > proven_here for c in pool if c is not own):
        return d
    order = (own, *(c for c in d.order if c.id != own.id))
    if facts.ledger_usable and proven_here > 0:
        return replace(d, order=order, mode=EXACT, reason=REASON, hit_tokens=proven_here * facts.block_size)
    # No proven block on it: nothing is claimed; the mode still names what was known (p2c, round robin).
    return replace(d, order=order, mode=LOAD_AWARE if d.mode == EXACT else d.mode, reason=REASON, hit_tokens=0)
