"""The ingest -> extproc contract: the one document ingest publishes in the ledger view's meta area.

Ingest owns the fleet (which targets exist, their health, load and whether their ledger can be trusted);
extproc routes on it. The only thing that crosses the process boundary besides the key bitsets is this
document, so it is written down once, here, as msgspec Structs that ingest encodes (`encode_meta`) and
extproc decodes (`read_meta`, from the view's bytes); extproc also builds the same structs from its config while
ingest has not spoken yet (extproc/cluster_view.py).

Versioning: `version` is a major version. Adding an optional field with a default does not change it (an
older reader ignores a field it does not know; a newer reader fills in the default when an older writer
omitted it). Renaming, removing or changing the meaning of a field does: a reader refuses a document of any
version it was not written for (`ContractError`), and extproc then treats the view as unusable (routes by
its config and its own in-flight counts, claims no hit) instead of misreading it. That is what a rolling
restart that starts a newer ingest next to an older extproc looks like. A document without `version` is
version 1: the layout ingest published before the field existed.

Version 2 added `TargetMeta.groups`: a hybrid model's target slot lists only its full-attention spec, so a
version-1 reader, which does not know the other specs, would claim hits the engine will not serve. Ingest writes
the lowest version that describes the document (`version_of`): 1 while no target has groups (a fleet without
hybrid models keeps its exact routing through a rolling restart), 2 once one has. This code reads both.
"""

from __future__ import annotations

from typing import Any

import msgspec

SCHEMA_VERSION = 2
"""The newest version this code writes."""
READABLE = (1, 2)
"""The versions this code reads."""


def target_id(worker: str, rank: int | None) -> str:
    """A target's id: its worker's, with `@<rank>` for one data-parallel rank of it."""
    return worker if rank is None else f"{worker}@{rank}"


class ContractError(ValueError):
    """A meta document this process cannot read: a version it was not written for, or a malformed field."""


LOAD_MAX_AGE_S = 2.0
"""An engine load reading older than this (or than two poll intervals in force, if longer) is unknown."""


def load_max_age_s(every_s: float) -> float:
    """How old a reading taken every `every_s` may get before it is unknown: two missed readings in a row
    (an idle worker polled every ingest.idle_load_poll_interval_s is not flagged for being idle). Extproc ages
    the readings it routes by with it, and ingest the busy state its silence check judges by."""
    return max(LOAD_MAX_AGE_S, 2 * every_s)


class LoadReading(msgspec.Struct, frozen=True):
    """One engine load reading (running and waiting requests of one target)."""

    running: float = 0.0
    waiting: float = 0.0
    at: float | None = None
    """When it was read: the host's monotonic clock, which ingest and extproc share (None: never read)."""
    every_s: float = 0.0
    """The load poll interval in force, so the reader can age the reading itself (docs/performance.md)."""
    age_s: float | None = None
    """Legacy (documents from before `at`): the reading's age when it was published."""
    kv_usage: float | None = None
    """Share of the KV-cache pool held by running requests at that reading, 0..1 (vLLM kv_cache_usage_perc,
    SGLang token_usage); None: not reported. Claims on a nearly full pool are withheld (policies/claims.py)."""
    kv_capacity_tokens: float | None = None
    """The pool in tokens (vLLM cache_config_info, SGLang max_total_num_tokens); None: not reported."""
    evicted_tokens: float | None = None
    """Tokens the engine has evicted from its pool since its ledger started (its BlockRemoved events), at that
    reading; None: not known (a writer from before the field)."""
    evicted_tokens_per_s: float | None = None
    """How many it has been evicting per second lately (an average that follows rises fast); None: not known."""
    regretted_tokens_per_s: float | None = None
    """How many of the tokens it evicted per second lately had to be computed again soon after, by it or another
    engine (ingest/regret.py); None: not known."""
    inflight: float | None = None
    """This replica's requests in flight there at that reading (its extproc processes' in-flight board): between
    readings extproc adds its own in-flight change since to the reading (extproc/cluster_view.py derived_load).
    None: not known (a writer from before the field); the reading is then taken as it is."""


class GroupSlot(msgspec.Struct, frozen=True):
    """One KV-cache spec of a hybrid model's target: the slot whose bitset lists the blocks every group of that
    spec holds on the GPU, and how the engine's hit rule reads it (cortex/hit_rule.py)."""

    slot: int
    kind: str
    """`full` (a prefix run) or `window` (the blocks of the window back from the hit point)."""
    need: int = 0
    """`window`: consecutive blocks a hit must end with."""


class TierSlot(msgspec.Struct, frozen=True):
    """One lower tier of a target (its blocks offloaded to CPU memory or storage): the slot listing them."""

    slot: int
    medium: str
    """`CPU` or `STORAGE` (cortex.kv_events.TIERS)."""


class TargetMeta(msgspec.Struct, frozen=True):
    """One routing target: a worker, or one data-parallel rank of it, as extproc sees it."""

    id: str
    """`<worker>` or `<worker>@<rank>`."""
    slot: int
    """Its column in the ledger view's bitsets."""
    model: str
    address: str
    """host:port Envoy sends its requests to."""
    worker: str | None = None
    """The worker it belongs to (None: the same as `id`)."""
    rank: int | None = None
    """Data-parallel rank, or None for a worker without DP."""
    engine: str = "vllm"
    healthy: bool = True
    """Routable: false after `ingest.health_failures` consecutive failed probes."""
    suspect: bool = False
    """Not in good standing (never probed yet, or its latest probe failed): routed, but never first."""
    exact_kv: bool = False
    """Ingest vouches for its ledger: stream in sync, hash and tokenizer parity not failed, events flowing."""
    state: str = ""
    """The event stream's sync state (ingest.sync.SyncState), for people; extproc does not read it."""
    reason: str = ""
    """Why its ledger is not trusted, in words ('' when it is)."""
    why: str | None = None
    """The same as a short reason code for headers and metrics (None: '' when exact_kv, else ledger_unknown)."""
    load: LoadReading = msgspec.field(default_factory=LoadReading)
    added_at: float | None = None
    """When ingest added it (monotonic)."""
    age_s: float | None = None
    """Legacy (documents from before `added_at`): seconds since it was added, at publication."""
    role: str = "both"
    """`both`, `prefill` or `decode` (PD pools, docs/pd.md)."""
    bootstrap_port: int | None = None
    """SGLang prefill: the port its decode connects to (None until read)."""
    tls_name: str | None = None
    """An https worker: the name its certificate must carry (upstream_tls, cortex/upstream_tls.py), which extproc's
    own requests to it check. None: plain http."""
    groups: tuple[GroupSlot, ...] = ()
    """A hybrid model's KV-cache specs, `slot`'s (its full-attention spec) among them; empty: one full-attention
    spec, whose hit is `slot`'s leading run (schema version 2)."""
    tiers: tuple[TierSlot, ...] = ()
    """Lower tiers the target publishes (offloaded copies); empty: GPU only."""
    lookahead_blocks: int = 0
    """Blocks the engine's hit may fall short of a matched run because its hashes fold in tokens after each
    block (vLLM lookahead hashing, speculative drafters): the claim leaves them out."""


class ClusterMeta(msgspec.Struct, frozen=True, kw_only=True):
    """The whole meta document of the ledger view."""

    version: int = 1
    """SCHEMA_VERSION of the writer; absent in documents from before versioning, which are version 1."""
    block_size: int
    """Tokens per Cortex block key (the view's keys are chained over blocks of this size)."""
    targets: list[TargetMeta]


_encoder = msgspec.json.Encoder()


def version_of(meta: ClusterMeta) -> int:
    """The lowest schema version that describes `meta` (module docstring)."""
    return 2 if any(t.groups for t in meta.targets) else 1


def encode_meta(meta: ClusterMeta) -> bytes:
    """Ingest's side: the document as JSON bytes, stamped with the lowest version that describes it."""
    version = version_of(meta)
    if meta.version != version:
        meta = msgspec.structs.replace(meta, version=version)
    return _encoder.encode(meta)


class _Peek(msgspec.Struct):
    """A document's version and whether it names a fleet, read without decoding its targets."""

    version: Any = msgspec.UNSET
    targets: msgspec.Raw = msgspec.Raw()
    """Left undecoded (empty: absent)."""


_peek = msgspec.json.Decoder(_Peek)
_typed = msgspec.json.Decoder(ClusterMeta)


def _check_version(version: object) -> None:
    if type(version) is not int or version not in READABLE:
        raise ContractError(f"meta document has schema version {version!r}; this process reads versions "
                            f"{', '.join(map(str, READABLE))} only (a newer or older ingest is running: finish the "
                            "rolling restart so both sides run the same release)")


def read_meta(raw: bytes) -> ClusterMeta | None:
    """extproc's side, from the view's bytes: the document as a ClusterMeta, decoded into the structs in one pass
    (no intermediate dicts: at 256 targets a third of the time of parsing, then converting). None for a document
    that names no fleet yet (neither `targets` nor `version`: an empty view). Raises ContractError as
    `decode_meta` does, the version checked first."""
    if not raw:
        return None
    try:
        peek = _peek.decode(raw)
    except msgspec.ValidationError:
        raise ContractError("meta document is not an object") from None
    except msgspec.DecodeError as exc:
        raise ContractError(f"meta document is not JSON: {exc}") from None
    if peek.version is msgspec.UNSET and not len(peek.targets):
        return None
    version = 1 if peek.version is msgspec.UNSET else peek.version
    _check_version(version)
    try:
        return _typed.decode(raw)
    except msgspec.DecodeError as exc:  # ValidationError included
        raise ContractError(f"meta document (schema version {version}) is malformed: {exc}") from None


def decode_meta(doc: dict[str, Any] | bytes) -> ClusterMeta:
    """A published document (parsed JSON, or its bytes) as a ClusterMeta. Raises ContractError, naming the
    reason, for a version this code was not written for or a malformed document; the version is checked first,
    so a newer layout is reported as such rather than as a bad field."""
    if isinstance(doc, bytes | bytearray | memoryview):
        try:
            doc = msgspec.json.decode(doc)
        except msgspec.DecodeError as exc:
            raise ContractError(f"meta document is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ContractError(f"meta document is a {type(doc).__name__}, not an object")
    version = doc.get("version", 1)
    _check_version(version)
    try:
        return msgspec.convert(doc, ClusterMeta)
    except msgspec.ValidationError as exc:
        raise ContractError(f"meta document (schema version {version}) is malformed: {exc}") from None
