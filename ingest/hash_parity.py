"""Hash parity: recompute the engine's own block hashes from an event's token ids and compare.

Cortex's keys come from the events' token ids, so they do not depend on the engine's hash. But the
engine's hash is a fingerprint of its configuration: a mismatch means the worker does not run what the
config says (another page size, hash algorithm or PYTHONHASHSEED, usually another deployment of the
model), and its cache cannot be trusted to line up with Cortex's tokenizer. Such a worker leaves
exact-KV routing with the reason spelled out. Checked where the engine hash is reproducible: chain
starts (no parent: a parent's full digest is not on the wire) without LoRA (vLLM hashes the adapter path,
which events do not carry; SGLang namespaces LoRA hashes with an internal key). The first few chain
starts are all checked, then one in `sample_every`, so the cost stays off the ingest budget.
"""

from __future__ import annotations

from dataclasses import dataclass

from cortex import engines
from cortex.blockkeys import event_suffixes
from cortex.engines import ChainStartHasher, NotReproducible
from ingest.events import BlockStored

UNKNOWN, OK, FAILED, UNCHECKED = "unknown", "ok", "failed", "unchecked"


@dataclass
class ParityCheck:
    engine: str
    page_size: int
    hash_algo: str | None = "sha256"
    hash_seed: str | None = None
    max_blocks: int = 4
    warmup: int = 8
    sample_every: int = 64
    status: str = UNKNOWN
    reason: str = "no chain start seen yet"
    checked: int = 0
    failures: int = 0
    _seen: int = 0

    def __post_init__(self) -> None:
        self._hasher: ChainStartHasher | None = None
        self._unchecked = ""
        try:
            self._hasher = engines.adapter(self.engine).chain_start_hasher(self.hash_algo, self.hash_seed)
        except NotReproducible as exc:
            # The page size is still checked.
            self._unchecked = str(exc)
            self.status, self.reason = UNCHECKED, self._unchecked

    @property
    def failed(self) -> bool:
        return self.status == FAILED

    def reset(self) -> None:
        """A restarted publisher may run another configuration: judge it afresh."""
        if self._hasher is None:
            # Back to unchecked, also after a page-size failure: there is still no hash to compare against.
            self.status, self.reason = UNCHECKED, self._unchecked
        else:
            self.status, self.reason = UNKNOWN, "no chain start seen yet"
        self._seen = 0

    def observe(self, event: BlockStored, salt: str | None) -> None:
        if event.block_size != self.page_size:
            self._fail(f"events use page size {event.block_size}, config says {self.page_size}")
            return
        hasher = self._hasher
        if (hasher is None or self.status in (FAILED, UNCHECKED) or event.parent_block_hash is not None
                or event.lora_name):
            return
        n = min(len(event.block_hashes), self.max_blocks)
        with_content = event_suffixes(event.extra_keys)
        if with_content:
            # A block with media or prompt embeds is hashed with keys the event does not carry whole (vLLM hashes
            # them tagged): only the blocks before the first such one are recomputed.
            n = min(n, min(with_content))
            if n == 0:
                return
        self._seen += 1
        if self._seen > self.warmup and self._seen % self.sample_every:
            return
        tokens = event.token_ids[: n * event.block_size]
        expected = hasher.wire_hashes(tokens, event.block_size, salt)
        how = hasher.how
        self.checked += 1
        got = event.block_hashes[:n]
        if expected != got:
            i = next(i for i, (a, b) in enumerate(zip(expected, got, strict=True)) if a != b)
            self._fail(f"block {i} of a chain start hashes to {got[i]} on the worker but {expected[i]} by {how} "
                       "(check the engine's page size, --prefix-caching-hash-algo and PYTHONHASHSEED)")
        elif self.status == UNKNOWN:
            self.status, self.reason = OK, f"engine hashes reproduced ({how})"

    def _fail(self, reason: str) -> None:
        if self.status != FAILED:
            self.failures += 1
        self.status, self.reason = FAILED, reason
