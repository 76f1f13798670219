"""A small synthetic trace in the Mooncake format (`python -m cortexbench.trace generate`; the shipped one is
perf/traces/mooncake-small.jsonl, `--seed 1`)."""

from __future__ import annotations

import itertools
import math
import random
from typing import Any

from cortexbench.trace_mooncake import BLOCK_TOKENS


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))))


def generate(*, seed: int, sessions: int = 100, duration_s: float = 90.0, block_tokens: int = BLOCK_TOKENS,
             prefixes: int = 8, prefix_blocks: tuple[int, int] = (1, 4), no_prefix_share: float = 0.2,
             max_turns: int = 6, think_s: float = 6.0, first_median: int = 1200, turn_median: int = 300,
             output_median: int = 100, max_input: int = 10240) -> list[dict[str, Any]]:
    """A small synthetic trace: conversations that share hash-id prefixes, as Mooncake's do.

    `prefixes` shared system prompts of `prefix_blocks` whole blocks, Zipf-popular (weight 1 / rank); a share
    `no_prefix_share` of conversations has none. A conversation starts at a uniform time in the first 80 % of
    `duration_s` and has 1 to `max_turns` turns (fewer more likely), `think_s` seconds apart on average
    (exponential). Its first prompt adds a log-normal number of tokens (median `first_median`) to its system
    prompt; each later turn re-sends the whole context plus the last answer (its output_length) and a new
    message (median `turn_median`), so its hash ids extend the last turn's full blocks; the last, partial block
    gets a fresh id each turn, as a hash of different content would. Outputs are log-normal (median
    `output_median`). A conversation ends before its prompt would exceed `max_input` tokens; lines arriving
    after `duration_s` are dropped.

    The defaults are scaled to 8 simulated workers of 16 384 KV tokens: about 230 lines over 90 s (~2.7 per
    second, ~9 000 prompt tokens a second: the benchmark's oracle, which has every worker tokenize every
    prompt, fell behind at twice that on the 2-core machine), prompts of ~300 to 10 240 tokens (median ~2 700,
    mean ~3 100; a worker holds three of the longest), a working set of ~2 x the fleet's KV. From empty caches
    no router can hit more than ~0.6 of the prompt tokens (what the trace repeats)."""
    rng = random.Random(seed)
    ids = itertools.count()
    shared = [[next(ids) for _ in range(rng.randint(*prefix_blocks))] for _ in range(prefixes)]
    cum = list(itertools.accumulate(1.0 / (k + 1) for k in range(prefixes)))
    turn_weights = [1.0 / (k + 1) for k in range(max_turns)]
    out: list[dict[str, Any]] = []
    for n in range(sessions):
        t = rng.uniform(0.0, 0.8 * duration_s)
        full = [] if rng.random() < no_prefix_share else list(shared[rng.choices(range(prefixes), cum_weights=cum)[0]])
        length = len(full) * block_tokens
        turns = rng.choices(range(1, max_turns + 1), weights=turn_weights)[0]
        last_output = 0
        for turn in range(turns):
            new = (_lognormal(rng, first_median, 0.8, 64, max_input) if turn == 0
                   else last_output + _lognormal(rng, turn_median, 0.7, 16, max_input))
            output = _lognormal(rng, output_median, 0.8, 4, 1024)
            if turn:
                t += rng.expovariate(1.0 / think_s)
            if length + new > max_input or t >= duration_s:
                break
            length += new
            whole = length // block_tokens
            full.extend(next(ids) for _ in range(whole - len(full)))
            hash_ids = full[:whole] + ([next(ids)] if length % block_tokens else [])
            out.append({"timestamp": round(t * 1000), "input_length": length, "output_length": output,
                        "hash_ids": hash_ids, "session_id": f"s{n}"})
            last_output = output
    out.sort(key=lambda d: d["timestamp"])
    return out
