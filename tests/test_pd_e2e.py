"""Prefill/decode pools through the real Envoy + Cortex, in front of simulated SGLang and vLLM PD workers.

Each failure path must end in a clean client outcome (an answer, or an OpenAI-shaped error) within a bounded
time, with no leg left running: the simulated engines' bootstrap and transfer queues are read back to prove it.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.harness import MODEL, Gateway, Sim, free_ports, long_chat, pd_cluster, start_sim, stop, wait_for

pytestmark = pytest.mark.timeout(240)

CHAT = "/v1/chat/completions"


def chat(gw: Gateway, seed: int, *, stream: bool = False, words: int = 400, timeout: float = 60) -> httpx.Response:
    body: dict[str, Any] = {"model": MODEL, "messages": long_chat(words, seed), "max_tokens": 4, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return httpx.post(f"{gw.url}{CHAT}", json=body, timeout=timeout)


def usage_cached(resp: httpx.Response) -> int:
    if resp.headers.get("content-type", "").startswith("text/event-stream"):
        import json
        frames = [json.loads(line[6:]) for line in resp.text.splitlines()
                  if line.startswith("data: {")]
        usage = next(f["usage"] for f in reversed(frames) if f.get("usage"))
    else:
        usage = resp.json()["usage"]
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def sglang_queues(sim: Sim) -> tuple[float, float]:
    """(prefill bootstrap queue, decode transfer queue) as the simulated SGLang worker reports them."""
    text = httpx.get(f"{sim.url}/metrics", timeout=5).text
    def value(name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name) and not line.startswith("#"))
    return value("sglang:num_prefill_bootstrap_queue_reqs"), value("sglang:num_decode_transfer_queue_reqs")


def assert_openai_error(resp: httpx.Response, reason: str | None = None) -> None:
    """A 5xx in the OpenAI form; with `reason`, the dropped reason it carries under both names."""
    assert resp.status_code >= 500, resp.text
    err = resp.json()["error"]
    assert err["message"] and err["type"] and err["code"] == resp.status_code
    if reason is not None:
        assert resp.headers["x-cortex-dropped-reason"] == reason, dict(resp.headers)
        assert resp.headers["x-llm-d-request-dropped-reason"] == reason


# -- SGLang: concurrent legs with a bootstrap room -------------------------------------------------------------

SGLANG = [
    ("p1", "sglang", "prefill", True, ("--disaggregation-bootstrap-port", "0")),
    ("p2", "sglang", "prefill", True, ("--disaggregation-bootstrap-port", "0")),
    ("d1", "sglang", "decode", False, ("--waiting-timeout", "120")),
]


@pytest.fixture(scope="module")
def sglang_gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with pd_cluster(tmp_path_factory.mktemp("pd-sglang"), SGLANG, {"pd": {"bootstrap_timeout_s": 3.0}}) as gw:
        yield gw


def test_sglang_pair_streams_and_claims_the_prefill_hit(sglang_gw: Gateway) -> None:
    gw = sglang_gw
    first = chat(gw, seed=1)
    assert first.status_code == 200, first.text
    assert first.headers["x-cortex-pd"] == "pair"
    assigned = first.headers["x-cortex-assigned-worker"]
    prefill = assigned.split(",")[0].removeprefix("prefill=")
    assert prefill in ("p1", "p2") and assigned.endswith("decode=d1")
    # The prefill worker's events reach the ledger; the same prompt then goes to the same prefill with a hit.
    wait_for(lambda: gw.targets()[prefill]["cached_blocks"] > 0, what="prefill blocks in the ledger")
    for stream in (False, True):
        again = chat(gw, seed=1, stream=stream)
        assert again.status_code == 200, again.text
        assert again.headers["x-cortex-assigned-worker"] == assigned
        assert again.headers["x-cortex-match-mode"] == "exact_kv_events"
        assert again.headers["x-cortex-route-reason"].startswith("pd:")
        hit = int(again.headers["x-cortex-cache-hit-tokens"])
        # The decode reports the prefill's cached tokens in its usage: that is the hit to check against.
        assert hit > 0 and hit <= usage_cached(again) < hit + 16  # Cortex claims whole 16-token blocks
        if stream:
            assert again.text.rstrip().endswith("data: [DONE]")
    p = next(s for s in gw.sims if s.id == prefill)
    assert sglang_queues(p)[0] == 0 and sglang_queues(gw.sims[2])[1] == 0
    # The observer sees the pair as the decode's request, the prefill beside it, with the claim checked.
    def observed() -> list[dict[str, Any]] | None:
        ds = httpx.get(f"{gw.observe_url}/cortex/decisions?limit=3", timeout=5).json()["decisions"]
        return ds if len(ds) >= 3 else None

    wait_for(observed, timeout=20, what="the pair's requests observed")
    newest = (observed() or [])[0]
    assert (newest["worker"], newest["mode"]) == ("d1", "exact_kv_events")
    assert 0 < newest["claimed_hit_tokens"] <= newest["engine_cached_tokens"]


def test_sglang_bootstrap_never_arrives_is_cut_by_the_watchdog(sglang_gw: Gateway) -> None:
    gw = sglang_gw
    d1 = gw.sims[2]
    httpx.post(f"{d1.url}/sim/faults", json={"pd_stall_bootstrap": True}, timeout=5).raise_for_status()
    try:
        t0 = time.monotonic()
        resp = chat(gw, seed=2, timeout=30)
        took = time.monotonic() - t0
        assert_openai_error(resp, "pd_bootstrap_timeout")
        assert took < 20  # the watchdog (3 s here), not the engines' 120-300 s timeouts
        # Both legs were cancelled: nothing waits in a prefill bootstrap queue or the decode's transfer queue.
        wait_for(lambda: all(sglang_queues(s) == (0, 0) for s in gw.sims), timeout=10, what="queues drained")
    finally:
        httpx.post(f"{d1.url}/sim/faults", json={"pd_stall_bootstrap": False}, timeout=5)
    assert chat(gw, seed=3).status_code == 200


def test_sglang_failing_prefills_end_in_a_clear_error(sglang_gw: Gateway) -> None:
    gw = sglang_gw
    prefills = [s for s in gw.sims if s.role == "prefill"]
    for p in prefills:
        httpx.post(f"{p.url}/sim/faults", json={"http_5xx_rate": 1.0}, timeout=5).raise_for_status()
    try:
        t0 = time.monotonic()
        resp = chat(gw, seed=6, timeout=30)
        assert_openai_error(resp, "pd_prefill_failed")
        assert time.monotonic() - t0 < 15
        wait_for(lambda: all(sglang_queues(s) == (0, 0) for s in gw.sims), timeout=10, what="queues drained")
    finally:
        for p in prefills:
            httpx.post(f"{p.url}/sim/faults", json={"http_5xx_rate": 0.0}, timeout=5)
    metrics = httpx.get(f"{gw.ingest_url}/metrics", timeout=5).text
    assert 'cortex_pd_failures_total{engine="sglang"' in metrics
    assert 'cortex_pd_decisions_total{engine="sglang",outcome="pair"}' in metrics


def test_sglang_dead_prefill_is_repicked(sglang_gw: Gateway) -> None:
    gw = sglang_gw
    first = chat(gw, seed=4)
    assert first.status_code == 200, first.text
    holder_id = first.headers["x-cortex-assigned-worker"].split(",")[0].removeprefix("prefill=")
    holder = next(s for s in gw.sims if s.id == holder_id)
    wait_for(lambda: gw.targets()[holder_id]["cached_blocks"] > 0, what="holder in the ledger")
    assert holder.proc is not None
    os.killpg(holder.proc.pid, signal.SIGKILL)
    holder.proc.wait(5)
    # The ledger still says the dead worker holds the prefix (health needs 3 failed probes): Cortex picks it,
    # cannot reach it, and starts a new pair on the other prefill before the decode is sent.
    resp = chat(gw, seed=4)
    assert resp.status_code == 200, resp.text
    other = "p2" if holder_id == "p1" else "p1"
    assert resp.headers["x-cortex-assigned-worker"] == f"prefill={other},decode=d1"
    assert resp.headers["x-cortex-pd"] in ("pair:repicked", "pair")
    assert resp.headers["x-cortex-cache-hit-tokens"] == "0" or resp.headers["x-cortex-pd"] == "pair"
    # Once both prefill workers are gone (and no worker serves alone) the client gets a clear error, fast.
    other_sim = next(s for s in gw.sims if s.id == other)
    stop(other_sim.proc)
    t0 = time.monotonic()
    resp = chat(gw, seed=5, timeout=30)
    assert_openai_error(resp, "pd_prefill_failed")
    assert resp.status_code == 502  # extproc's own answer: the pair never started
    assert time.monotonic() - t0 < 15
    assert sglang_queues(gw.sims[2]) == (0, 0)


def test_sglang_dead_decode_is_replaced_then_reported(tmp_path: Path) -> None:
    specs = [("p1", "sglang", "prefill", True, ("--disaggregation-bootstrap-port", "0")),
             ("d1", "sglang", "decode", False, ()), ("d2", "sglang", "decode", False, ())]
    # The question is what a pair does with decoders that died while Cortex still lists them. Health probes are
    # kept out of it (a minute of failures before a worker is down): otherwise what is decided depends on which
    # probes ran first. Two decoders gone from the view answer 503 at once; every worker gone (the prefill too, after
    # three slow probes on a loaded machine) makes the request wait in the room for one to come back (queue_ttl, 30 s).
    with pd_cluster(tmp_path, specs, {"pd": {"bootstrap_timeout_s": 3.0}},
                    extra_config={"ingest": {"health_failures": 60}}) as gw:
        p1, d1, d2 = gw.sims
        assert d1.proc is not None
        os.killpg(d1.proc.pid, signal.SIGKILL)
        d1.proc.wait(5)
        # A decoder that cannot be reached never saw the room: Envoy's connect retry takes the next decoder, which
        # completes the same pair.
        for seed in range(40, 44):
            resp = chat(gw, seed=seed)
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-cortex-assigned-worker"] == "prefill=p1,decode=d2"
        stop(d2.proc)
        t0 = time.monotonic()
        resp = chat(gw, seed=45, timeout=30)
        assert all(w["healthy"] for w in gw.workers().values())  # the view still lists every worker
        assert_openai_error(resp, "pd_decode_failed")
        assert time.monotonic() - t0 < 15
        # The prefill leg of the broken pair was cancelled, not left in the bootstrap queue.
        wait_for(lambda: sglang_queues(p1) == (0, 0), timeout=10, what="prefill bootstrap queue drained")


def test_sglang_data_parallel_prefill_rank_follows_the_room(tmp_path: Path) -> None:
    specs = [("p1", "sglang", "prefill", True, ("--disaggregation-bootstrap-port", "0")),
             ("d1", "sglang", "decode", False, ())]
    with pd_cluster(tmp_path, specs, dp={"p1": 2}) as gw:
        first = chat(gw, seed=50)
        assert first.status_code == 200, first.text
        rank_target = first.headers["x-cortex-assigned-worker"].split(",")[0].removeprefix("prefill=")
        assert rank_target in ("p1@0", "p1@1")
        wait_for(lambda: gw.targets()[rank_target]["cached_blocks"] > 0, what="rank blocks in the ledger")
        # The room was drawn so the prefill's follow_bootstrap_room balancing lands on the rank the ledger
        # proves: the engine's reported hit matches Cortex's claim, several times over.
        for _ in range(3):
            again = chat(gw, seed=50)
            assert again.headers["x-cortex-assigned-worker"] == first.headers["x-cortex-assigned-worker"]
            hit = int(again.headers["x-cortex-cache-hit-tokens"])
            assert hit > 0 and hit <= usage_cached(again) < hit + 16


# -- vLLM: sequential legs with kv_transfer_params ---------------------------------------------------------------

VLLM = [
    ("vp1", "vllm", "prefill", True, ()),
    ("vd1", "vllm", "decode", True, ("--kv-load-failure-policy", "fail")),
]


@pytest.fixture(scope="module")
def vllm_gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with pd_cluster(tmp_path_factory.mktemp("pd-vllm"), VLLM) as gw:
        yield gw


def prompt_tokens_total(sim: Sim) -> float:
    text = httpx.get(f"{sim.url}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prompt_tokens_total"))


def test_vllm_pair_hands_transfer_params_to_the_decode(vllm_gw: Gateway) -> None:
    gw = vllm_gw
    for stream in (False, True):
        before = prompt_tokens_total(gw.sims[0])
        resp = chat(gw, seed=10 + stream, stream=stream)
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-cortex-pd"] == "pair"
        assert resp.headers["x-cortex-assigned-worker"] == "prefill=vp1,decode=vd1"
        assert prompt_tokens_total(gw.sims[0]) > before + 400  # the prefill leg computed the prompt
        if stream:
            assert resp.text.rstrip().endswith("data: [DONE]")
    # The decoder pulled the prefill's blocks and caches them itself (its own events say so).
    wait_for(lambda: gw.targets()["vd1"]["cached_blocks"] > 0, what="transferred blocks on the decoder")
    wait_for(lambda: gw.targets()["vp1"]["cached_blocks"] > 0, what="prefill blocks in the ledger")
    # The decoder now holds the whole prompt: the prefill leg would only repeat a transfer (skip rule 2).
    before = prompt_tokens_total(gw.sims[0])
    again = chat(gw, seed=10)
    assert again.status_code == 200, again.text
    assert again.headers["x-cortex-pd"] == "skipped:decode_holds_prefix"
    assert again.headers["x-cortex-assigned-worker"] == "vd1"
    assert again.headers["x-cortex-match-mode"] == "exact_kv_events"
    hit = int(again.headers["x-cortex-cache-hit-tokens"])
    assert hit > 0 and hit <= usage_cached(again) < hit + 16
    assert prompt_tokens_total(gw.sims[0]) == before


def test_vllm_skip_prefill_for_a_short_prompt_saves_the_transfer(vllm_gw: Gateway) -> None:
    gw = vllm_gw
    before = prompt_tokens_total(gw.sims[0])
    resp = httpx.post(f"{gw.url}{CHAT}", json={"model": MODEL, "max_tokens": 2,
                                                "messages": [{"role": "user", "content": "Say hi."}]}, timeout=30)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-cortex-pd"] == "skipped:short_uncached_part"
    assert resp.headers["x-cortex-assigned-worker"] == "vd1"
    assert prompt_tokens_total(gw.sims[0]) == before  # the prefill worker never saw it


def test_vllm_decode_rejecting_the_transfer_falls_back_to_a_worker_of_the_pair(vllm_gw: Gateway) -> None:
    gw = vllm_gw
    vp1 = gw.sims[0]
    httpx.post(f"{vp1.url}/sim/faults", json={"pd_transfer_fail": True}, timeout=5).raise_for_status()
    try:
        t0 = time.monotonic()
        resp = chat(gw, seed=20, timeout=30)
        assert time.monotonic() - t0 < 20
        # No mixed worker: NIXL workers serve alone, and the decoder that failed is left out, so the prefill worker
        # answers the request itself (before, the client got the decoder's 500).
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-cortex-pd"] == "fallback:decode_failed"
        assert resp.headers["x-cortex-assigned-worker"] == "vp1"
        assert int(resp.headers["x-cortex-cache-hit-tokens"]) <= usage_cached(resp)
    finally:
        httpx.post(f"{vp1.url}/sim/faults", json={"pd_transfer_fail": False}, timeout=5)
    assert chat(gw, seed=21).status_code == 200


def test_transparent_mode_makes_no_kv_or_pd_decision(vllm_gw: Gateway) -> None:
    import yaml
    gw = vllm_gw
    cfg_path = gw.root / "cortex.yaml"
    original = cfg_path.read_text()
    cfg = yaml.safe_load(original)
    cfg["models"][0]["scheduling"] = "transparent"
    cfg_path.write_text(yaml.safe_dump(cfg))
    try:
        def transparent() -> bool:
            r = chat(gw, seed=10)
            return r.headers.get("x-cortex-route-reason") == "transparent_proxy"
        wait_for(transparent, timeout=15, interval=0.5, what="config reload")
        resp = chat(gw, seed=10)
        assert resp.status_code == 200
        assert "x-cortex-pd" not in resp.headers  # no pair, no skip: another scheduler owns placement
        assert resp.headers["x-cortex-cache-hit-tokens"] == "0"
        assert resp.headers["x-cortex-match-mode"] != "exact_kv_events"
    finally:
        cfg_path.write_text(original)


def test_a_vllm_prefill_longer_than_envoys_message_deadline_still_pairs(tmp_path: Path) -> None:
    specs = [("vp1", "vllm", "prefill", True, ("--prefill-ms-per-token", "3")),  # ~600 tokens: ~1.8 s
             ("vd1", "vllm", "decode", True, ())]
    with pd_cluster(tmp_path, specs, extra_config={"extproc": {"message_timeout_ms": 400}}) as gw:
        resp = chat(gw, seed=60, words=450)
        assert resp.status_code == 200, resp.text
        # extproc extended Envoy's per-message deadline before awaiting the prefill leg; without that, Envoy would
        # have given up on extproc and sent the request down its fallback route, unpaired.
        assert resp.headers.get("x-cortex-pd") == "pair"
        assert resp.headers["x-cortex-assigned-worker"] == "prefill=vp1,decode=vd1"


def test_both_pools_empty_is_a_clear_error(tmp_path: Path) -> None:
    specs = [("q1", "vllm", "prefill", True, ())]
    with pd_cluster(tmp_path, specs) as gw:
        resp = chat(gw, seed=30)
        assert resp.status_code == 503
        assert "no healthy decode worker" in resp.json()["error"]["message"]
        assert resp.headers["x-cortex-dropped-reason"] == "no_worker"
        # A decoder registered through the admin API, with its role, completes the pool.
        port, kv = free_ports(2)
        dec = Sim(id="q2", port=port, kv_port=kv, engine="vllm", role="decode")
        start_sim(dec, tmp_path)
        try:
            r = httpx.post(f"{gw.ingest_url}/cortex/workers", json=dec.worker_config(), timeout=10)
            assert r.status_code in (200, 201), r.text
            def paired() -> bool:
                return chat(gw, seed=31).headers.get("x-cortex-pd") == "pair"
            wait_for(paired, timeout=20, interval=0.5, what="the new decoder paired")
        finally:
            stop(dec.proc)


# -- Mixed pools: a `both` worker beside the pair (issue 11 #9 and #12) ---------------------------------------------

def set_faults(sims: list[Sim], **faults: Any) -> None:
    for s in sims:
        httpx.post(f"{s.url}/sim/faults", json=faults, timeout=5).raise_for_status()


def served_alone(resp: httpx.Response, why: str, worker: str) -> None:
    """A fallback answer: 200 from one worker, named in the headers, with no claim the engine did not make."""
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-cortex-pd"] == f"fallback:{why}"
    assert resp.headers["x-cortex-assigned-worker"] == worker
    assert int(resp.headers["x-cortex-cache-hit-tokens"]) <= usage_cached(resp)


SGLANG_MIXED = [
    ("p1", "sglang", "prefill", True, ("--disaggregation-bootstrap-port", "0")),
    ("d1", "sglang", "decode", False, ("--waiting-timeout", "120")),
    ("m1", "sglang", "both", True, ()),
]


@pytest.fixture(scope="module")
def sglang_mixed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    # Health probes every 30 s: the unreachable-prefill case kills p1 and must reach the PD attempt; probed every
    # second, a loaded machine's slow test had p1 suspect before its request, which then went to m1 without any.
    with pd_cluster(tmp_path_factory.mktemp("pd-sglang-mixed"), SGLANG_MIXED,
                    {"pd": {"bootstrap_timeout_s": 3.0}}, extra_config={"ingest": {"health_interval_s": 30.0}}) as gw:
        yield gw


def test_sglang_repeat_cached_on_the_prefill_keeps_its_pair(sglang_mixed: Gateway) -> None:
    gw = sglang_mixed
    first = chat(gw, seed=70)
    assert first.status_code == 200, first.text
    assert first.headers["x-cortex-pd"] == "pair"
    assert first.headers["x-cortex-assigned-worker"] == "prefill=p1,decode=d1"
    wait_for(lambda: gw.targets()["p1"]["cached_blocks"] > 0, what="prefill blocks in the ledger")
    # Only p1 holds the prompt; the mixed worker m1 holds none of it. Serving alone on m1 would compute the whole
    # prompt again (the old rule skipped to it: 'skipped:short_uncached_part', hit 0, cached_tokens 0).
    for stream in (False, True):
        again = chat(gw, seed=70, stream=stream)
        assert again.status_code == 200, again.text
        assert again.headers["x-cortex-pd"] == "pair"
        assert again.headers["x-cortex-assigned-worker"] == "prefill=p1,decode=d1"
        hit = int(again.headers["x-cortex-cache-hit-tokens"])
        assert hit > 0 and hit <= usage_cached(again) < hit + 16


def test_sglang_failed_prefill_falls_back_to_the_mixed_worker(sglang_mixed: Gateway) -> None:
    gw = sglang_mixed
    p1, d1, _ = gw.sims
    set_faults([p1], http_5xx_rate=1.0)
    try:
        for stream in (False, True):
            resp = chat(gw, seed=71 + stream, stream=stream)
            served_alone(resp, "prefill_failed", "m1")
            if stream:
                assert resp.text.rstrip().endswith("data: [DONE]")
        wait_for(lambda: all(sglang_queues(s) == (0, 0) for s in (p1, d1)), timeout=10, what="queues drained")
    finally:
        set_faults([p1], http_5xx_rate=0.0)


def test_sglang_stalled_bootstrap_falls_back_before_the_first_byte(sglang_mixed: Gateway) -> None:
    gw = sglang_mixed
    p1, d1, _ = gw.sims
    set_faults([d1], pd_stall_bootstrap=True)
    try:
        for stream in (False, True):
            t0 = time.monotonic()
            resp = chat(gw, seed=73 + 10 * stream, stream=stream, timeout=60)
            # The watchdog (3 s) cut the pair, aborted both legs, and the mixed worker served the request from
            # scratch. A streamed decode answers its 200 at once (as SGLang does): Cortex holds those headers until
            # the prefill leg settles, so the failure is still before the client's first byte.
            served_alone(resp, "bootstrap_timeout", "m1")
            assert time.monotonic() - t0 < 30
            if stream:
                assert resp.text.rstrip().endswith("data: [DONE]") and '"error"' not in resp.text
            wait_for(lambda: all(sglang_queues(s) == (0, 0) for s in (p1, d1)), timeout=10, what="queues drained")
    finally:
        set_faults([d1], pd_stall_bootstrap=False)
    metrics = httpx.get(f"{gw.ingest_url}/metrics", timeout=5).text
    assert 'cortex_pd_decisions_total{engine="sglang",outcome="fallback:bootstrap_timeout"}' in metrics


def test_sglang_unreachable_prefill_falls_back_to_the_mixed_worker(sglang_mixed: Gateway) -> None:
    gw = sglang_mixed
    p1, d1, _ = gw.sims
    assert p1.proc is not None
    os.killpg(p1.proc.pid, signal.SIGKILL)  # last test of this fixture: the prefill stays dead
    p1.proc.wait(5)
    # The prefill leg cannot be written: no decode leg is sent at all, and Envoy serves the request on the mixed
    # worker as any single-worker request (streamed as usual).
    for stream in (False, True):
        resp = chat(gw, seed=74 + stream, stream=stream)
        served_alone(resp, "prefill_failed", "m1")
        if stream:
            assert resp.text.rstrip().endswith("data: [DONE]")
    assert sglang_queues(d1) == (0, 0)


VLLM_MIXED = [
    ("vp1", "vllm", "prefill", True, ()),
    ("vp2", "vllm", "prefill", True, ()),
    # The decoder's own copy of transferred blocks is not in the ledger: only the prefill side proves a hit.
    ("vd1", "vllm", "decode", False, ("--kv-load-failure-policy", "fail")),
    ("vm1", "vllm", "both", True, ()),
]


@pytest.fixture(scope="module")
def vllm_mixed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with pd_cluster(tmp_path_factory.mktemp("pd-vllm-mixed"), VLLM_MIXED) as gw:
        yield gw


def test_vllm_repeat_cached_on_the_prefill_keeps_its_pair(vllm_mixed: Gateway) -> None:
    gw = vllm_mixed
    first = chat(gw, seed=80)
    assert first.status_code == 200, first.text
    assert first.headers["x-cortex-pd"] == "pair"
    prefill = first.headers["x-cortex-assigned-worker"].split(",")[0].removeprefix("prefill=")
    wait_for(lambda: gw.targets()[prefill]["cached_blocks"] > 0, what="prefill blocks in the ledger")
    again = chat(gw, seed=80)
    assert again.status_code == 200, again.text
    assert again.headers["x-cortex-pd"] == "pair"
    assert again.headers["x-cortex-assigned-worker"] == f"prefill={prefill},decode=vd1"
    hit = int(again.headers["x-cortex-cache-hit-tokens"])
    assert hit > 0 and hit <= usage_cached(again) < hit + 16


def test_vllm_failed_prefill_is_repicked(vllm_mixed: Gateway) -> None:
    gw = vllm_mixed
    first = chat(gw, seed=81)
    assert first.status_code == 200, first.text
    holder = first.headers["x-cortex-assigned-worker"].split(",")[0].removeprefix("prefill=")
    wait_for(lambda: gw.targets()[holder]["cached_blocks"] > 0, what="holder in the ledger")
    other = "vp2" if holder == "vp1" else "vp1"
    sims = {s.id: s for s in gw.sims}
    before = prompt_tokens_total(sims[other])
    # The ledger sends the prompt to its holder, which now fails: a new pair on the other prefill, before the
    # decode leg is sent; the hit claimed is 0 (the new prefill was not the one the ledger proved).
    set_faults([sims[holder]], http_5xx_rate=1.0)
    try:
        resp = chat(gw, seed=81)
    finally:
        set_faults([sims[holder]], http_5xx_rate=0.0)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-cortex-pd"] == "pair:repicked"
    assert resp.headers["x-cortex-assigned-worker"] == f"prefill={other},decode=vd1"
    assert resp.headers["x-cortex-cache-hit-tokens"] == "0"
    assert prompt_tokens_total(sims[other]) > before + 400


def test_vllm_failed_prefills_fall_back_to_the_mixed_worker(vllm_mixed: Gateway) -> None:
    gw = vllm_mixed
    prefills = [s for s in gw.sims if s.role == "prefill"]
    set_faults(prefills, http_5xx_rate=1.0)
    try:
        for stream in (False, True):
            resp = chat(gw, seed=82 + stream, stream=stream)
            served_alone(resp, "prefill_failed", "vm1")
    finally:
        set_faults(prefills, http_5xx_rate=0.0)


def test_vllm_failed_transfer_falls_back_before_the_first_byte(vllm_mixed: Gateway) -> None:
    gw = vllm_mixed
    prefills = [s for s in gw.sims if s.role == "prefill"]
    vm1 = gw.sims[3]
    set_faults(prefills, pd_transfer_fail=True)
    try:
        for stream in (False, True):
            before = prompt_tokens_total(vm1)
            resp = chat(gw, seed=84 + stream, stream=stream)
            # The decoder could not read the KV and answered 500; nothing had reached the client, so the mixed
            # worker computed the prompt itself and its answer is the client's.
            served_alone(resp, "decode_failed", "vm1")
            assert prompt_tokens_total(vm1) > before + 400
            if stream:
                assert resp.headers["content-type"].startswith("text/event-stream")
                assert resp.text.rstrip().endswith("data: [DONE]")
    finally:
        set_faults(prefills, pd_transfer_fail=False)
    metrics = httpx.get(f"{gw.ingest_url}/metrics", timeout=5).text
    assert 'cortex_pd_decisions_total{engine="vllm",outcome="fallback:decode_failed"}' in metrics


def test_a_fallback_longer_than_envoys_message_deadline_still_answers(tmp_path: Path) -> None:
    specs = [("vp1", "vllm", "prefill", True, ()),
             ("vd1", "vllm", "decode", True, ("--kv-load-failure-policy", "fail")),
             ("vm1", "vllm", "both", True, ("--prefill-ms-per-token", "3"))]  # ~600 tokens: ~1.8 s
    with pd_cluster(tmp_path, specs, extra_config={"extproc": {"message_timeout_ms": 400}}) as gw:
        set_faults([gw.sims[0]], pd_transfer_fail=True)
        resp = chat(gw, seed=90, words=450)
        # extproc extended Envoy's deadline for the response-headers message before serving the request alone;
        # without that, Envoy would have given up on extproc and passed the decoder's 500 to the client.
        served_alone(resp, "decode_failed", "vm1")
