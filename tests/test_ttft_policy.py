"""The time model (extproc/policies/ttft.py), its queue (extproc/backlog.py, cortex/inflight.py: BacklogBoard) and
its calibration (cortex/calibration.py), with vectors: each case states the facts and the decision they must give."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from cortex.calibration import MAX_FACTOR, MIN_SAMPLES, Calibration, Learner
from cortex.config import SchedulerConfig
from cortex.inflight import BacklogBoard, Touch, TouchBoard
from extproc import candidates
from extproc.backlog import Backlog
from extproc.cluster_view import TargetInfo
from extproc.policies import Ttft
from extproc.policies.base import EXACT, LOAD_AWARE, Candidate, Decision, Facts
from extproc.policies.claims import KV_PRESSURE
from extproc.policies.ttft import estimate, prefill_ms
from extproc.predictions import Predictions

BS = 16
S = SchedulerConfig()
# Round numbers for the vectors: 0.05 ms a token, 10 ms a step, no attention or interference term.
FLAT = SchedulerConfig(alpha_ms_per_token=0.05, attention_ms_per_token2=0.0, step_ms=10.0, step_tokens=8192,
                       running_ms_per_request=0.0, work_weight=0.25)


def cand(i: int, *, matched: int = 0, backlog: float = 0.0, load: float = 0.0, waiting: float = 0.0,
         calibration: float = 1.0, hot: bool = False, predicted: int = 0) -> Candidate:
    return Candidate(id=f"w{i}", slot=i, address=f"127.0.0.1:{9000 + i}", matched_blocks=matched,
                     ledger_trusted=True, engine_load=load, engine_waiting=waiting, backlog_ms=backlog,
                     calibration=calibration, hot=hot, predicted_blocks=max(predicted, matched))


def decide(cands: list[Candidate], prompt_tokens: int, s: SchedulerConfig = FLAT, seed: int = 1,
           typical: float | None = None) -> Decision:
    facts = Facts(BS, True, "no_cached_prefix", s, prompt_tokens=prompt_tokens, typical_prefill_ms=typical)
    return Ttft().decide(cands, facts, random.Random(seed))


def test_prefill_cost_vectors() -> None:
    assert prefill_ms(0, 4096, 0, FLAT) == 10.0  # a full hit still takes the step that samples the first token
    assert prefill_ms(8192, 0, 0, FLAT) == pytest.approx(10 + 409.6)
    assert prefill_ms(8193, 0, 0, FLAT) == pytest.approx(20 + 409.65)  # a second chunk, a second step
    s = SchedulerConfig(alpha_ms_per_token=0.0, attention_ms_per_token2=1e-6, step_ms=0.0, running_ms_per_request=0.0)
    # Attention grows with the context: 1000 new tokens after 31 000 cached cost 1000 x 31 500 x 1e-6 ms.
    assert prefill_ms(1000, 31_000, 0, s) == pytest.approx(31.5)
    assert prefill_ms(1000, 0, 0, s) == pytest.approx(0.5)
    busy = SchedulerConfig(alpha_ms_per_token=0.0, attention_ms_per_token2=0.0, step_ms=5.0, running_ms_per_request=0.1)
    assert prefill_ms(20_000, 0, 100, busy) == pytest.approx(3 * (5 + 10))  # three steps, each beside 100 decodes


def test_a_short_wait_on_the_holder_beats_recomputing_elsewhere() -> None:
    # 8 000-token prompt, w0 holds 7 680 of it and has 100 ms of prefill queued: 100 + 10 + 16 = 126 ms there,
    # against 10 + 400 = 410 ms on an idle w1.
    d = decide([cand(0, matched=480, backlog=100.0), cand(1)], 8000)
    assert d.chosen.id == "w0" and d.mode == EXACT and d.hit_tokens == 480 * BS
    assert d.estimates["w0"].ttft_ms == pytest.approx(126.0)
    assert d.estimates["w1"].ttft_ms == pytest.approx(410.0)


def test_a_long_queue_on_the_holder_sends_the_request_to_an_idle_worker() -> None:
    # The same holder with 2 s queued: 2 026 ms there, 410 ms (score 410 + 0.25 x 410) on the idle worker.
    d = decide([cand(0, matched=480, backlog=2000.0), cand(1)], 8000)
    assert d.chosen.id == "w1"
    assert d.mode == LOAD_AWARE and d.hit_tokens == 0 and d.reason == "holder_slower"
    assert [c.id for c in d.order] == ["w1", "w0"]  # the retry goes to the next fastest


def test_requests_are_counted_by_their_work_not_their_number() -> None:
    # w0 runs 30 short requests (a few ms of work queued), w1 two long ones (3 s queued): the old rule would
    # avoid w0 for its count; the time model sends the prompt where its wait is shortest.
    d = decide([cand(0, load=30.0, backlog=40.0), cand(1, load=2.0, backlog=3000.0)], 2000)
    assert d.chosen.id == "w0"


def test_a_burst_stays_together_while_the_wait_costs_it_nothing() -> None:
    # The burst's first copy was just sent to w0 (predicted, 410 ms of prefill queued there). The second copy
    # waits that long on w0 and then computes nothing; on idle w1 it computes everything in the same time. Equal
    # TTFTs: the work term keeps it on w0, and nothing is claimed (a prediction is not proof).
    d = decide([cand(0, predicted=500, backlog=410.0), cand(1)], 8000)
    assert d.chosen.id == "w0" and d.mode == LOAD_AWARE and d.reason == "predicted_prefix" and d.hit_tokens == 0


def test_work_other_replicas_sent_shows_through_the_engines_queue() -> None:
    # No backlog of our own anywhere, but w0's engine reports 4 waiting requests of a typical 500 ms each.
    d = decide([cand(0, waiting=4.0, load=4.0), cand(1)], 4000, typical=500.0)
    assert d.chosen.id == "w1"
    assert d.estimates["w0"].queue_ms == pytest.approx(2000.0)


def test_a_slow_worker_learns_its_own_rate() -> None:
    # w0 holds half the prompt but its observed TTFTs run 3x the model: 3 x (10 + 200) = 630 ms against 410.
    d = decide([cand(0, matched=250, calibration=3.0), cand(1)], 8000)
    assert d.chosen.id == "w1"
    assert d.estimates["w0"].ttft_ms == pytest.approx(630.0)
    fair = decide([cand(0, matched=250), cand(1)], 8000)
    assert fair.chosen.id == "w0"


def test_ties_take_turns_and_go_home_for_a_prompt_nobody_holds() -> None:
    idle = [cand(i) for i in range(4)]
    picks = {decide(idle, 1000, seed=seed).chosen.id for seed in range(40)}
    assert picks == {"w0", "w1", "w2", "w3"}
    homed = {Ttft().decide(idle, Facts(BS, True, "no_cached_prefix", FLAT, home=12345, prompt_tokens=1000),
                           random.Random(seed)).chosen.id for seed in range(40)}
    assert len(homed) == 1  # every replica sends the same new prompt to the same idle worker


def test_several_replicas_spread_near_ties_by_prompt_and_keep_identical_prompts_together() -> None:
    # Four replicas deciding at once see the same fleet: every worker holds the shared system block, w3 has a
    # little work queued, w4 five seconds. Alone, every prompt goes to one of the three idle ones (its home among
    # them: they tie); told of the replicas, each prompt goes to its home among the four best within one typical
    # prefill (300 ms), w3 included, the same on every replica.
    fleet = [cand(0, matched=32), cand(1, matched=32), cand(2, matched=32), cand(3, matched=32, backlog=100.0),
             cand(4, matched=32, backlog=5000.0)]
    four = FLAT.model_copy(update={"replicas": 4})

    def pick(s: SchedulerConfig, home: int, seed: int = 1, cands: list[Candidate] = fleet) -> Decision:
        facts = Facts(BS, True, "no_cached_prefix", s, home=home, prompt_tokens=4000, typical_prefill_ms=300.0)
        return Ttft().decide(cands, facts, random.Random(seed))

    alone = {h: pick(FLAT, h).chosen.id for h in range(1, 200)}
    assert set(alone.values()) == {"w0", "w1", "w2"}
    spread = {h: pick(four, h) for h in range(1, 200)}
    assert {d.chosen.id for d in spread.values()} == {"w0", "w1", "w2", "w3"}  # never w4: 5 s behind is not near
    moved = [d for h, d in spread.items() if d.chosen.id != alone[h]]
    assert moved and all(d.reason == "replica_spread" and d.mode == EXACT and d.hit_tokens == 32 * BS
                         for d in moved)
    # The same prompt on every replica (any seed): one worker, so a client's n samples still meet.
    assert len({pick(four, 777, seed).chosen.id for seed in range(20)}) == 1
    # A band of 0 is one replica's rule.
    assert all(pick(four.model_copy(update={"replica_band": 0.0}), h).chosen.id == alone[h] for h in range(1, 50))
    # Spreading never gives up a cached block: a holder of more of the prompt keeps it, even inside the band
    # (w0 saves 1.6 ms over the others here, far less than the 300-ms band).
    holder = [cand(0, matched=33), *fleet[1:]]
    assert {pick(four, h, cands=holder).chosen.id for h in range(1, 200)} == {"w0"}


def test_estimate_names_its_parts() -> None:
    facts = Facts(BS, True, "", FLAT, prompt_tokens=1000)
    est = estimate(cand(0, matched=10, backlog=50.0, calibration=2.0), facts)
    assert est.uncached_tokens == 1000 - 160
    assert est.queue_ms == 50.0 and est.prefill_ms == pytest.approx(10 + 0.05 * 840)
    assert est.ttft_ms == pytest.approx(2 * (50 + 10 + 42))
    assert est.to_json()["predicted_ttft_ms"] == pytest.approx(204.0)


def target(i: int) -> TargetInfo:
    return TargetInfo(id=f"w{i}", worker=f"w{i}", rank=None, slot=i, model="m", engine="vllm",
                      address=f"127.0.0.1:{9000 + i}", exact_kv=True, healthy=True, engine_load=0.0)


def test_the_queue_watermark_has_hysteresis() -> None:
    """A holder whose predicted queue climbs through high_queue_ms gets no traffic until it is back under
    low_queue_ms, even where its cached prefix would still make it the fastest."""
    s = SchedulerConfig(high_queue_ms=1000.0, low_queue_ms=500.0)
    hysteresis = candidates.Hysteresis()
    picks = []
    for queue in (800.0, 1000.0, 700.0, 500.0, 800.0):
        cands = candidates.build([target(0), target(1)], matches=np.array([2000, 0]), keys=list(range(2000)),
                                 inflight=np.zeros(2, dtype=np.int64), alive=True, predictions=Predictions(),
                                 hysteresis=hysteresis, scoring=s, backlog_ms=np.array([queue, 0.0]))
        hysteresis.carry(cands)
        picks.append(decide(cands, 32_000, s).chosen.id)
    assert picks == ["w0", "w1", "w1", "w0", "w0"]


def test_the_request_count_rule_is_kept_for_comparison() -> None:
    """Under rule cache_aware the queue watermark is not applied (the old rule, as it was)."""
    s = SchedulerConfig(rule="cache_aware", high_queue_ms=1000.0, low_queue_ms=500.0)
    cands = candidates.build([target(0)], matches=np.array([10]), keys=list(range(10)),
                             inflight=np.zeros(1, dtype=np.int64), alive=True, predictions=Predictions(),
                             hysteresis=candidates.Hysteresis(), scoring=s, backlog_ms=np.array([5000.0]))
    assert not cands[0].hot


def test_backlog_drains_with_the_clock_and_sums_over_processes(tmp_path: Path) -> None:
    a = BacklogBoard(tmp_path, 0, 2, 4)
    b = BacklogBoard(tmp_path, 1, 2, 4)
    a.push(2, 300.0, now=100.0)
    a.push(2, 200.0, now=100.1)  # queued behind the first: done at 100.5
    b.push(2, 100.0, now=100.2)
    assert a.backlog_ms(now=100.2)[2] == pytest.approx(300.0 + 100.0)
    assert a.backlog_ms(now=100.45)[2] == pytest.approx(50.0)  # b's work is done, a's has 50 ms left
    assert a.backlog_ms(now=101.0).tolist() == [0.0, 0.0, 0.0, 0.0]
    a.push(2, 100.0, now=200.0)  # an idle worker's queue starts now, not behind old work
    assert a.backlog_ms(now=200.0)[2] == pytest.approx(100.0)


def test_a_request_that_ended_settles_its_prefill_and_what_was_queued_before_it(tmp_path: Path) -> None:
    """A request's end settles its predicted prefill at once (a prediction that ran long leaves no phantom queue),
    and the prefill of every request queued there before it (engines admit prompts in order); what was queued
    after it stays queued, from now on. A request already settled by a later one's end changes nothing."""
    q = Backlog(BacklogBoard(tmp_path, 0, 1, 4))
    first, second, third = q.commit(1, 80_000.0), q.commit(1, 30_000.0), q.commit(1, 20_000.0)
    assert q.remaining_ms()[1] == pytest.approx(130_000.0, rel=1e-3)
    q.settle(1, second)  # the first two are done: the third's 20 s are left
    assert q.remaining_ms()[1] == pytest.approx(20_000.0, rel=1e-3)
    q.settle(1, first)  # done already
    assert q.remaining_ms()[1] == pytest.approx(20_000.0, rel=1e-3)
    q.settle(1, third)
    assert q.remaining_ms()[1] == 0.0
    other = q.commit(2, 50_000.0)
    q.settle(3, other)  # another slot's receipt: nothing there
    assert q.remaining_ms()[2] == pytest.approx(50_000.0, rel=1e-3)


def test_backlog_learns_the_typical_request(tmp_path: Path) -> None:
    q = Backlog(BacklogBoard(tmp_path, 0, 1, 2))
    assert q.typical_ms is None
    q.commit(0, 400.0)
    assert q.typical_ms == 400.0
    for _ in range(200):
        q.commit(1, 100.0)
    assert q.typical_ms == pytest.approx(100.0, abs=1.0)


def test_calibration_is_a_bounded_ratio_of_sums(tmp_path: Path) -> None:
    learner = Learner()
    for _ in range(MIN_SAMPLES - 1):
        learner.add("slow", 100.0, 300.0)
    assert learner.factors() == {}  # too few observations to publish
    learner.add("slow", 100.0, 300.0)
    learner.add("tiny", 1.0, 500.0)  # below MIN_PREDICTED_MS: the gateway, not the worker, dominates it
    assert learner.factors() == {"slow": pytest.approx(3.0)}
    for _ in range(MIN_SAMPLES):
        learner.add("stuck", 50.0, 60_000.0)
    assert learner.factors()["stuck"] == MAX_FACTOR
    path = tmp_path / "calibration.json"
    learner.write(path)
    reader = Calibration(path)
    reader.refresh()
    assert reader.factors == {"slow": pytest.approx(3.0), "stuck": MAX_FACTOR}
    path.write_text("{not json")
    reader.refresh()
    assert reader.factors["slow"] == pytest.approx(3.0)  # a bad file keeps what was read before


def test_calibration_reader_without_a_file_keeps_every_factor_at_one(tmp_path: Path) -> None:
    reader = Calibration(tmp_path / "absent.json")
    reader.refresh()
    assert reader.factors == {}


def test_a_hit_on_a_nearly_full_pool_is_not_claimed() -> None:
    """Until the engine schedules the request, other requests' allocations evict the least recently used free
    blocks: on a pool held 95 % by running requests the holder is still chosen, but nothing is claimed."""
    full = Candidate(id="w0", slot=0, address="a:1", matched_blocks=400, ledger_trusted=True, engine_load=1.0,
                     kv_usage=0.95)
    d = decide([full, cand(1)], 8000)
    assert d.chosen.id == "w0" and d.hit_tokens == 0
    assert d.mode == LOAD_AWARE and d.reason == KV_PRESSURE
    roomy = Candidate(id="w0", slot=0, address="a:1", matched_blocks=400, ledger_trusted=True, engine_load=1.0,
                      kv_usage=0.5)
    d = decide([roomy, cand(1)], 8000)
    assert d.chosen.id == "w0" and d.mode == EXACT and d.hit_tokens == 400 * BS
    always = SchedulerConfig(claim_max_kv_usage=1.0, attention_ms_per_token2=0.0)
    assert decide([full, cand(1)], 8000, always).hit_tokens == 400 * BS


def test_other_replicas_work_is_priced_like_our_own() -> None:
    """4 active requests on w0 that this replica did not send (another replica's), and this replica's own two
    in flight elsewhere with 300 ms of prefill left each on average: w0 is priced 4 x 300 ms of queue."""
    targets = [TargetInfo(id=f"w{i}", worker=f"w{i}", rank=None, slot=i, model="m", engine="vllm",
                          address=f"127.0.0.1:{9000 + i}", exact_kv=True, healthy=True, engine_load=load)
               for i, load in enumerate((4.0, 2.0, 0.0))]
    cands = candidates.build(targets, matches=np.array([0, 0, 0]), keys=[1], inflight=np.array([0, 2, 0]),
                             alive=True, predictions=Predictions(), hysteresis=candidates.Hysteresis(), scoring=S,
                             backlog_ms=np.array([0.0, 600.0, 0.0]))
    assert [c.foreign_ms for c in cands] == [1200.0, 0.0, 0.0]
    d = decide(cands, 4000)
    assert d.chosen.id == "w2" and [c.id for c in d.order] == ["w2", "w1", "w0"]
    alone = candidates.build(targets, matches=np.array([0, 0, 0]), keys=[1], inflight=np.zeros(3, dtype=np.int64),
                             alive=True, predictions=Predictions(), hysteresis=candidates.Hysteresis(), scoring=S,
                             backlog_ms=np.zeros(3))
    assert [c.foreign_ms for c in alone] == [0.0, 0.0, 0.0]  # nothing of our own in flight: no evidence of the mix


def evicting(*, sent: Touch | None, rate: float = 1000.0, usage: float = 0.5, pool: float = 8000.0,
             backlog: float = 0.0, uncounted: float = 0.0) -> Candidate:
    """A holder of 100 blocks whose engine evicts `rate` tokens a second from a pool whose free part is
    (1 - usage) x pool (4 000 tokens with the defaults)."""
    return Candidate(id="w0", slot=0, address="a:1", matched_blocks=100, ledger_trusted=True, engine_load=1.0,
                     kv_usage=usage, kv_capacity_tokens=pool, evicted_tokens_per_s=rate, last_sent=sent,
                     backlog_ms=backlog, uncounted_s=uncounted)


@pytest.mark.parametrize(("cand_", "claimed"), [
    # Share 0.5 of a free part of 4 000 tokens: 1 500 evicted since the prefix was last sent there stay under
    # 2 000; 2 050 do not.
    (evicting(sent=Touch(0.9, 1500.0)), True),
    (evicting(sent=Touch(0.9, 2050.0)), False),
    # Evictions since the count was read (0.6 s x 1 000/s) are added.
    (evicting(sent=Touch(0.9, 1500.0), uncounted=0.6), False),
    # So is one per token of the prefill queued ahead (30 ms at 0.05 ms a token: 600 tokens to allocate).
    (evicting(sent=Touch(0.5, 1500.0), backlog=30.0), False),
    (evicting(sent=Touch(0.5, 1300.0), backlog=30.0), True),
    # A prefix this replica never sent there is taken as claim_unknown_age_s (30 s) old, at the recent rate.
    (evicting(sent=None), False),
    (evicting(sent=None, rate=50.0), True),  # 30 x 50 = 1 500 tokens
    # Nothing evicted since and nothing evicting: claimed, however long ago it was sent.
    (evicting(sent=Touch(600.0, 0.0), rate=0.0), True),
    # A pool held whole by running requests has no free part: anything unused goes first.
    (evicting(sent=Touch(0.01, 16.0), usage=1.0), False),
])
def test_a_hit_the_engines_lru_will_likely_have_reached_is_not_claimed(cand_: Candidate, claimed: bool) -> None:
    """On a pool that is evicting, the engine's LRU takes the least recently freed blocks at every allocation,
    overflow or not, and the BlockRemoved for what it evicts while scheduling reach the ledger only after that
    step: once the evictions since the prefix was freed approach the free part that stood in front of it, it
    is likely gone by admission."""
    s = SchedulerConfig(claim_horizon_share=0.5, claim_max_kv_usage=1.0, alpha_ms_per_token=0.05)
    d = decide([cand_], 1700, s, typical=100.0)
    assert d.chosen.id == "w0"
    assert (d.mode, d.hit_tokens) == ((EXACT, 1600) if claimed else (LOAD_AWARE, 0))


def test_the_touch_board_is_what_candidates_read_as_a_prefixs_last_send(tmp_path: Path) -> None:
    """A prefix this replica sent to w1 is counted from that send on w1 only (the evictions there since, as the
    published count says); w0, which holds it from someone else's traffic, has no last send."""
    board = TouchBoard(tmp_path, 0, 1, 4)
    clock = [100.0]
    preds = Predictions(clock=lambda: clock[0], touches=board)
    keys = [11, 12, 13]
    board.note_evicted(1, 5000.0)
    preds.record(1, keys)
    clock[0] += 2.5
    board.note_evicted(1, 5800.0)
    targets = [TargetInfo(id=f"w{i}", worker=f"w{i}", rank=None, slot=i, model="m", engine="vllm",
                          address=f"127.0.0.1:{9000 + i}", exact_kv=True, healthy=True, engine_load=0.0,
                          evicted_tokens_per_s=50.0) for i in range(2)]
    cands = candidates.build(targets, matches=np.array([3, 2]), keys=keys, inflight=np.zeros(2, dtype=np.int64),
                             alive=True, predictions=preds, hysteresis=candidates.Hysteresis(), scoring=S)
    assert cands[0].last_sent is None
    assert cands[1].last_sent == Touch(pytest.approx(2.5, abs=0.002), 800.0)  # type: ignore[arg-type]
    assert [c.evicted_tokens_per_s for c in cands] == [50.0, 50.0]
