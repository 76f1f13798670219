"""PD orchestration's pure parts, with vectors: the skip rule, the pair's state machine, the leg bodies."""

from __future__ import annotations

import random

import orjson
import pytest

from cortex.config import PdConfig
from extproc.cluster_view import TargetInfo
from extproc.pd import (
    SKIP_BATCH,
    SKIP_HELD,
    SKIP_N,
    SKIP_SHORT,
    fallback_pool,
    request_shape_skip,
    skip_by_cost,
    skip_reason,
    split_pools,
)
from extproc.pd_dispatch import (
    ABORT_DECODE,
    CANCEL_PREFILL,
    ROOM_MAX,
    Phase,
    on_event,
    sglang_room,
    splice,
    vllm_prefill_body,
)

CFG = PdConfig(skip_prefill_uncached_tokens=256, skip_prefill_decode_hit_ratio=0.8)


# Cost rule (docs/pd.md): skip when 2 * (prompt - single_cached) <= (prompt - prefill_cached) + 256.
@pytest.mark.parametrize(("prompt", "prefill_cached", "single_cached", "want"), [
    (100, 0, 0, SKIP_SHORT),         # nothing cached anywhere: a short prompt is cheaper alone (200 <= 356)
    (256, 0, 0, SKIP_SHORT),         # the old threshold, unchanged when nothing is cached (512 <= 512)
    (257, 0, 0, None),               # 514 > 513: a long new prompt gets its pair (the prefill off the decoder)
    (2000, 0, 0, None),
    # Issue 11 #12: the prefill worker holds the prompt, the worker serving alone holds none of it. The old rule
    # saw 200 uncached tokens on the prefill side and skipped to the cold worker, which computed all 2000.
    (2000, 1800, 0, None),           # alone 2*2000 > 200+256
    (2000, 2000, 0, None),
    (300, 300, 0, None),             # even a short prompt: 600 > 0+256, the prefill's copy is cheaper
    (120, 120, 0, SKIP_SHORT),       # 240 <= 256: a handoff costs more than computing it alone
    (2000, 0, 1200, SKIP_SHORT),     # the lone worker holds more: 2*800 <= 2000+256
    (2000, 1000, 1000, None),        # equal copies: 2*1000 > 1000+256, the pair keeps the prefill off the decoder
    (2000, 1500, 1400, None),        # 2*600 > 500+256
    (2000, 1000, 1400, SKIP_SHORT),  # 2*600 <= 1000+256
    (2000, 0, 1600, SKIP_HELD),      # a worker serving alone already holds 80 %
    (2000, 1999, 1600, SKIP_HELD),
    (2000, 1999, 1599, None),        # just under the ratio; 2*401 > 1+256
    (0, 0, 0, SKIP_SHORT),
])
def test_skip_reason_vectors(prompt: int, prefill_cached: int, single_cached: int, want: str | None) -> None:
    assert skip_reason(prompt_tokens=prompt, prefill_cached_tokens=prefill_cached,
                       single_cached_tokens=single_cached, cfg=CFG) == want


@pytest.mark.parametrize(("prompt", "prefill_cached", "single_cached", "transfer", "want"), [
    (1000, 0, 0, 0, False),          # a free handoff: a new prompt always pairs
    (1000, 1000, 1000, 0, True),     # nothing to compute on either side: serve alone
    (1000, 0, 0, 1000, True),        # a handoff as dear as the prompt: 2000 <= 2000
    (1000, 0, 0, 999, False),
    (1000, 1200, 0, 0, False),       # a claim past the prompt counts as the whole prompt
    (1000, 0, 1200, 0, True),
])
def test_skip_by_cost_vectors(prompt: int, prefill_cached: int, single_cached: int, transfer: int,
                              want: bool) -> None:
    assert skip_by_cost(prompt_tokens=prompt, prefill_cached_tokens=prefill_cached,
                        single_cached_tokens=single_cached, transfer_tokens=transfer) is want


def _target(tid: str, role: str, engine: str, slot: int) -> TargetInfo:
    return TargetInfo(id=tid, worker=tid.split("@")[0], rank=None, slot=slot, model="m", engine=engine,
                      address=f"127.0.0.1:{9000 + slot}", exact_kv=True, healthy=True, engine_load=0.0, role=role,
                      bootstrap_port=8998 if role == "prefill" else None)


@pytest.mark.parametrize(("engine", "roles", "exclude", "want"), [
    ("sglang", ["prefill", "decode", "both"], set(), ["m"]),        # a mixed worker first
    ("vllm", ["prefill", "decode", "both"], {"m"}, ["m"]),          # ... even one of the pair's, if it is all
    ("vllm", ["prefill", "decode"], set(), ["d", "p"]),             # NIXL workers serve alone: decoder first
    ("vllm", ["prefill", "decode"], {"p"}, ["d"]),                  # not the prefill that just failed
    ("vllm", ["prefill", "decode"], {"d"}, ["p"]),                  # not the decoder that just failed
    ("vllm", ["prefill", "decode"], {"p", "d"}, ["d", "p"]),        # all failed: still try rather than refuse
    ("sglang", ["prefill", "decode"], set(), []),                   # SGLang PD servers cannot serve alone
])
def test_fallback_pool(engine: str, roles: list[str], exclude: set[str], want: list[str]) -> None:
    ids = {"prefill": "p", "decode": "d", "both": "m"}
    workers = [_target(ids[r], r, engine, k) for k, r in enumerate(roles)]
    assert [w.id for w in fallback_pool(split_pools(workers), frozenset(exclude))] == want


def test_request_shapes_a_pair_cannot_carry() -> None:
    assert request_shape_skip({"n": 2}, "vllm") == SKIP_N
    assert request_shape_skip({"n": 2}, "sglang") is None  # SGLang derives room+i per sample
    assert request_shape_skip({"prompt": ["a", "b"]}, "sglang") == SKIP_BATCH
    assert request_shape_skip({"prompt": [1, 2, 3]}, "vllm") is None  # one prompt of token ids
    assert request_shape_skip(None, "vllm") is None


# (phase, event) -> (next phase, actions): every path that ends a pair early frees the other leg.
@pytest.mark.parametrize(("phase", "event", "want_phase", "want_actions"), [
    (Phase.WAITING, "prefill_ok", Phase.PREFILLED, ()),
    (Phase.WAITING, "prefill_failed", Phase.FAILED, (ABORT_DECODE,)),
    (Phase.WAITING, "decode_failed", Phase.FAILED, (CANCEL_PREFILL,)),
    (Phase.WAITING, "watchdog", Phase.FAILED, (CANCEL_PREFILL, ABORT_DECODE)),
    (Phase.WAITING, "stream_end", Phase.DONE, (CANCEL_PREFILL,)),      # client went away
    (Phase.WAITING, "decode_ok", Phase.DECODE_STARTED, ()),           # streaming headers before the KV
    (Phase.DECODE_STARTED, "prefill_failed", Phase.FAILED, (ABORT_DECODE,)),
    (Phase.DECODE_STARTED, "watchdog", Phase.FAILED, (CANCEL_PREFILL, ABORT_DECODE)),
    (Phase.DECODE_STARTED, "prefill_ok", Phase.PREFILLED, ()),
    (Phase.PREFILLED, "decode_failed", Phase.FAILED, ()),             # vLLM: the prefill leg already ended
    (Phase.PREFILLED, "stream_end", Phase.DONE, ()),
    (Phase.PREFILLED, "watchdog", Phase.PREFILLED, ()),               # late: nothing left to guard
    (Phase.FAILED, "prefill_failed", Phase.FAILED, ()),
    (Phase.DONE, "prefill_ok", Phase.DONE, ()),
])
def test_pair_state_machine(phase: Phase, event: str, want_phase: Phase, want_actions: tuple[str, ...]) -> None:
    assert on_event(phase, event) == (want_phase, want_actions)


def test_no_phase_leaves_a_leg_running_at_stream_end() -> None:
    for phase in (Phase.WAITING, Phase.DECODE_STARTED):
        assert CANCEL_PREFILL in on_event(phase, "stream_end")[1]


def test_splice_appends_fields_without_reserialising() -> None:
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}  \n'
    out = splice(body, {"bootstrap_room": 7, "bootstrap_host": "10.0.0.1"})
    assert orjson.loads(out) == {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                 "bootstrap_room": 7, "bootstrap_host": "10.0.0.1"}
    assert out.startswith(b'{"model": "m", "messages"')
    assert orjson.loads(splice(b"{ }", {"a": 1})) == {"a": 1}
    assert splice(body, {}) is body


def test_vllm_prefill_body_follows_the_nixl_proxy() -> None:
    client = {"model": "m", "messages": [], "stream": True, "stream_options": {"include_usage": True},
              "max_tokens": 300, "max_completion_tokens": 300, "min_tokens": 5, "n": 1, "temperature": 0.3}
    leg = vllm_prefill_body(client, {"model": "served"})
    assert leg["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False,
                                         "remote_engine_id": None, "remote_block_ids": None,
                                         "remote_host": None, "remote_port": None}
    assert leg["stream"] is False and leg["max_tokens"] == 1 and leg["max_completion_tokens"] == 1
    assert "stream_options" not in leg and "min_tokens" not in leg
    assert leg["model"] == "served" and leg["temperature"] == 0.3
    assert client["max_tokens"] == 300 and "stream_options" in client  # the decode leg keeps the original


def test_sglang_room_lands_on_the_chosen_prefill_rank() -> None:
    rng = random.Random(0)
    for rank in range(4):
        for _ in range(50):
            room = sglang_room(rng, rank, 4)
            assert room % 4 == rank and 0 <= room <= ROOM_MAX
    assert 0 <= sglang_room(rng, None, 1) <= ROOM_MAX


def test_split_pools_pairs_an_sglang_prefill_only_once_its_bootstrap_port_is_known() -> None:
    from extproc.cluster_view import TargetInfo

    def t(i: str, role: str, engine: str = "sglang", port: int | None = None) -> TargetInfo:
        return TargetInfo(id=i, worker=i, rank=None, slot=0, model="m", engine=engine, address="127.0.0.1:1",
                          exact_kv=True, healthy=True, engine_load=0.0, role=role, bootstrap_port=port)

    pools = split_pools([t("p1", "prefill"), t("p2", "prefill", port=8998), t("d1", "decode"), t("b1", "both")])
    assert [w.id for w in pools.prefill] == ["p2"] and pools.pd_ready
    assert [w.id for w in pools.single] == ["b1"]  # an SGLang decoder cannot serve without a room
    vllm = split_pools([t("p1", "prefill", "vllm"), t("d1", "decode", "vllm")])
    assert [w.id for w in vllm.single] == ["d1"]  # a NIXL decoder prefills locally without transfer params
