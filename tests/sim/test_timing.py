"""The step cost model (cortexsim/timing.py): the formula on fixed vectors, the defaults' derivation, the engine's
use of it (prefill chunks at their position, decodes over their context, the interference a long prefill does to
a decoding request's step gap), and its plumbing through SimConfig and the CLI.

Nothing here measures wall-clock time: the engine is driven step by step (schedule, cost, finish) and the
assertions are on the modelled durations."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from cortexsim import timing
from cortexsim.cli import _parser, config_from_args
from cortexsim.config import SimConfig
from cortexsim.engine import EngineCore, SimRequest
from cortexsim.kv_events import NullEventPublisher
from cortexsim.prefix_cache import PrefixCache
from cortexsim.timing import TimingModel

# Round numbers, so every expected value below is arithmetic one can check by hand.
UNIT = TimingModel(prefill_ms_per_token=0.1, decode_ms_per_token=5.0, decode_ms_per_seq=0.5,
                   max_num_batched_tokens=8192, attention_ms_per_ktoken2=2.0, kv_read_ms_per_ktoken=0.25)
ZERO = TimingModel(prefill_ms_per_token=0, decode_ms_per_token=0, decode_ms_per_seq=0,
                   attention_ms_per_ktoken2=0, kv_read_ms_per_ktoken=0)


@pytest.mark.parametrize(("prefills", "decodes", "ms"), [
    ([], [], 5.0),                                  # the weight read alone
    ([(1000, 0)], [], 5.0 + 100 + 2.0 * 0.5),        # 1000 x 500 pairs = 0.5 M
    ([(1000, 1000)], [], 5.0 + 100 + 2.0 * 1.5 + 0.25),  # 1000 x 1500 pairs; reads the 1000 before it
    ([(1, 9999)], [], 5.0 + 0.1 + 2.0 * 0.0099995 + 0.25 * 9.999),  # a full hit's recomputed last token
    ([], [1000], 5.0 + 0.5 + 0.25),
    ([], [1000, 3000], 5.0 + 2 * 0.5 + 0.25 * 4),
    ([(2000, 0), (500, 4000)], [100] * 4,
     5.0 + 0.1 * 2500 + 2.0 * (2000 * 1000 + 500 * 4250) / 1e6 + 0.25 * 4 + 4 * (0.5 + 0.025)),
])
def test_step_ms_vectors(prefills: list[tuple[int, int]], decodes: list[int], ms: float) -> None:
    assert math.isclose(UNIT.step_ms(prefills, decodes), ms, rel_tol=1e-12)
    assert math.isclose(UNIT.step_seconds(prefills, decodes), ms / 1000, rel_tol=1e-12)


def test_a_prompt_costs_the_same_quadratic_attention_however_it_is_chunked() -> None:
    # Causal attention over n tokens is n^2 / 2 pairs whatever the chunking: each chunk c after p adds c*(p + c/2).
    n = 12_000
    whole = UNIT.step_ms([(n, 0)]) - UNIT.decode_ms_per_token
    chunks = [(c, p) for p, c in ((0, 5000), (5000, 5000), (10_000, 2000))]
    split = sum(UNIT.step_ms([chunk]) - UNIT.decode_ms_per_token for chunk in chunks)
    reads = 0.25 * (5000 + 10_000) / 1000  # the later chunks read the KV before them
    assert math.isclose(split, whole + reads)
    attention = 2.0 * n * n / 2 / 1e6
    assert math.isclose(whole, 0.1 * n + attention)
    # Doubling the prompt more than doubles its cost once attention matters.
    assert UNIT.cold_prefill_seconds(2 * n) > 2.2 * UNIT.cold_prefill_seconds(n)


def test_zero_coefficients_cost_nothing() -> None:
    assert ZERO.step_ms([(8192, 100_000), (1, 0)], [50_000] * 256) == 0
    assert ZERO.cold_prefill_seconds(100_000) == 0
    # The flags benchmarks pass for zero-compute workers set every term to 0.
    args = _parser().parse_args(list(timing.ZERO_COST_ARGS))
    assert config_from_args(args).timing.step_ms([(8192, 8192)], [10_000]) == 0


def test_defaults_are_derived_from_their_sources() -> None:
    assert timing.KV_BYTES_PER_TOKEN == 128 * 1024  # 2 x 32 layers x 8 KV heads x 128 x 2 bytes
    assert timing.ATTENTION_FLOPS_PER_PAIR == 4 * 32 * 4096
    d = TimingModel()
    # The weight read: 16.06 GB at 77 % of 3.35 TB/s.
    assert math.isclose(d.decode_ms_per_token, 16.06e9 / (0.77 * 3.35e12) * 1e3, rel_tol=5e-3)
    # Linear prefill: 2 x 8.03e9 FLOPs per token at 36 % of 989 TFLOPS.
    assert math.isclose(d.prefill_ms_per_token, 2 * 8.03e9 / (0.36 * 989e12) * 1e3, rel_tol=5e-3)
    # Attention: 10^6 pairs x 4 x 32 x 4096 FLOPs at 50 % of 989 TFLOPS.
    assert math.isclose(d.attention_ms_per_ktoken2, 1e6 * 524288 / (0.5 * 989e12) * 1e3, rel_tol=5e-3)
    # KV read: 1000 tokens x 128 KiB at 77 % of 3.35 TB/s.
    assert math.isclose(d.kv_read_ms_per_ktoken, 1000 * 131072 / (0.77 * 3.35e12) * 1e3, rel_tol=5e-3)
    assert d.max_num_batched_tokens == 8192
    # SimConfig and the CLI default to the same model.
    assert SimConfig().timing == d
    assert config_from_args(_parser().parse_args([])).timing == d


def test_default_cold_prefills_land_in_the_published_range() -> None:
    d = TimingModel()
    # ~0.4-0.7 s for an 8K-token prompt on one H100 with an 8B model (docs/simulator.md, "Timing model").
    assert 0.40 <= d.cold_prefill_seconds(8192) <= 0.70
    # 100K tokens: 13 chunks; attention (n^2 / 2 = 5e9 pairs, ~5.3 s) now costs more than the linear layers.
    hundred_k = d.cold_prefill_seconds(100_000)
    assert 9.0 < hundred_k < 11.0
    assert d.attention_ms_per_ktoken2 * 5e9 / 1e6 > d.prefill_ms_per_token * 100_000
    # A lone sequence decodes at the weight read plus its context; 256 short ones at ~12k tokens/s in all.
    assert 6.0 < d.step_ms(decode_contexts=[1000]) < 7.0
    assert 11_000 < 256 / d.step_seconds(decode_contexts=[700] * 256) < 14_000


def test_new_terms_are_plumbed_through_config_and_cli() -> None:
    args = _parser().parse_args(["--prefill-ms-per-token", "0.2", "--decode-ms-per-token", "9",
                                 "--decode-ms-per-seq", "0.3", "--attention-ms-per-ktoken2", "4.5",
                                 "--kv-read-ms-per-ktoken", "0.125", "--max-num-batched-tokens", "512"])
    cfg = config_from_args(args)
    cfg.validate()
    assert cfg.timing == TimingModel(prefill_ms_per_token=0.2, decode_ms_per_token=9, decode_ms_per_seq=0.3,
                                     max_num_batched_tokens=512, attention_ms_per_ktoken2=4.5,
                                     kv_read_ms_per_ktoken=0.125)
    for name in ("attention_ms_per_ktoken2", "kv_read_ms_per_ktoken"):
        kwargs: dict[str, Any] = {name: -1.0}
        with pytest.raises(ValueError, match=name):
            SimConfig(**kwargs).validate()


# --- the engine's schedule, step by step ---------------------------------------------------------------------

def engine(model: TimingModel, *, blocks: int = 2048) -> EngineCore:
    return EngineCore(PrefixCache(blocks, 16), NullEventPublisher(), model, max_running=64, output_token_ids=[7])


def submit(core: EngineCore, rid: str, prompt: int, max_tokens: int, base: int = 0) -> None:
    """A request of `prompt` distinct tokens from `base` on (as the API layer submits it: hashes computed)."""
    tokens = list(range(base, base + prompt))
    core.submit(SimRequest(rid, tokens, max_tokens, block_hashes=core.cache.prompt_hashes(tokens)))


def step(core: EngineCore) -> tuple[float, list[str], list[tuple[str, int]]]:
    """Schedule one step, read its modelled cost, run it: (ms, decoding ids, (prefilling id, chunk) pairs)."""
    scheduled = core._schedule()
    ms = core.step_seconds(scheduled) * 1000
    decodes = [r.request_id for r in scheduled.decodes]
    prefills = [(r.request_id, n) for r, n in scheduled.prefills]
    core._finish_step(scheduled)
    return ms, decodes, prefills


def test_the_engine_costs_each_chunk_at_its_position_and_each_decode_over_its_context() -> None:
    core = engine(dataclasses.replace(UNIT, max_num_batched_tokens=4096))
    submit(core, "a", 10_000, 2)
    ms, _, prefills = step(core)
    assert prefills == [("a", 4096)]
    assert math.isclose(ms, UNIT.step_ms([(4096, 0)]))
    ms, _, prefills = step(core)
    assert prefills == [("a", 4096)] and math.isclose(ms, UNIT.step_ms([(4096, 4096)]))
    ms, _, prefills = step(core)  # the last chunk: 1808 tokens after 8192; its first token is sampled now
    assert prefills == [("a", 1808)] and math.isclose(ms, UNIT.step_ms([(1808, 8192)]))
    ms, decodes, _ = step(core)  # the sampled token is computed over the whole prompt and itself
    assert decodes == ["a"] and math.isclose(ms, UNIT.step_ms(decode_contexts=[10_001]))


def test_a_cached_prefix_costs_no_compute_but_its_read_and_the_attention_over_it() -> None:
    core = engine(UNIT)
    submit(core, "a", 4000, 1)
    step(core)  # a prefills and finishes: its blocks stay cached
    submit(core, "b", 4000 + 96, 1)  # the same 4000 tokens (250 blocks) and 96 more
    ms, _, prefills = step(core)
    assert prefills == [("b", 96)]
    assert math.isclose(ms, UNIT.step_ms([(96, 4000)]))
    assert ms < UNIT.step_ms([(4096, 0)]) / 10


def test_decode_steps_grow_with_running_sequences_and_their_context() -> None:
    def decode_step_ms(n: int, prompt: int) -> float:
        core = engine(UNIT, blocks=8192)
        for i in range(n):
            submit(core, f"r{i}", prompt, 40, base=i * 100_000)
        while True:  # prefill them all, then time the first step in which all of them decode
            ms, decodes, prefills = step(core)
            if len(decodes) == n and not prefills:
                return ms

    one = decode_step_ms(1, 100)
    assert math.isclose(one, UNIT.step_ms(decode_contexts=[101]))
    assert math.isclose(decode_step_ms(16, 100), UNIT.step_ms(decode_contexts=[101] * 16))
    assert decode_step_ms(16, 100) > one + 15 * UNIT.decode_ms_per_seq - 1e-9
    # 16 contexts of 4001-4040 tokens (the first ones decoded while the others prefilled) instead of 101.
    extra = decode_step_ms(16, 4000) - decode_step_ms(16, 100)
    per_ktoken = UNIT.kv_read_ms_per_ktoken / 1000
    assert 16 * 3900 * per_ktoken <= extra <= 16 * 3940 * per_ktoken


def test_a_long_prefill_sharing_a_step_lengthens_a_decoding_requests_step_gap() -> None:
    # Request a is decoding; b's 6000-token prompt arrives. The steps a's tokens come out of are the intervals
    # between its tokens: the step it shares with b's prefill is as long as that prefill.
    def gaps(budget: int) -> list[tuple[float, int]]:
        model = TimingModel(prefill_ms_per_token=0.05, decode_ms_per_token=6.0, decode_ms_per_seq=0.02,
                            max_num_batched_tokens=budget, attention_ms_per_ktoken2=1.0,
                            kv_read_ms_per_ktoken=0.05)
        core = engine(model)
        submit(core, "a", 200, 40)
        step(core)  # a's prefill
        out: list[tuple[float, int]] = []
        for i in range(12):
            if i == 3:
                submit(core, "b", 6000, 1, base=50_000)
            ms, decodes, prefills = step(core)
            assert "a" in decodes  # decodes are scheduled first: a gets a token every step
            out.append((ms, sum(n for rid, n in prefills if rid == "b")))
        return out

    alone = gaps(8192)
    quiet = [ms for ms, b in alone if b == 0]
    shared = [ms for ms, b in alone if b > 0]
    assert [b for _, b in alone if b] == [6000]  # b fits one step: 8192 - a's one decode token
    assert max(quiet) < 7.0  # 6 + 0.02 + a's ~200-240 tokens of KV
    assert shared[0] > 40 * max(quiet)  # 6000 x 0.05 + 18 M pairs x 1.0 + the rest: ~330 ms of a's ITL
    # The step before b arrived, plus b's chunk: a's own decode costs what it did (its context is one longer).
    before = alone[2][0]
    assert math.isclose(shared[0], before + 6000 * 0.05 + 6000 * 3000 / 1e6, abs_tol=1e-3)

    # Chunked prefill (Sarathi-Serve): a 1024-token budget bounds a's gap per step, paid over more steps.
    chunked = gaps(1024)
    chunk_steps = [(ms, b) for ms, b in chunked if b]
    assert [b for _, b in chunk_steps] == [1023] * 5 + [6000 - 5 * 1023]
    assert max(ms for ms, _ in chunk_steps) < shared[0] / 4
    # Later chunks cost more than earlier ones of the same size: their attention spans the prompt so far.
    assert chunk_steps[4][0] > chunk_steps[0][0]
