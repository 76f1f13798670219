"""One routing decision: request -> tokens -> block keys -> ledger lookup -> candidates -> scheduler.

The same function serves real traffic and POST /cortex/v1/route, so the explain endpoint can never
disagree with what the gateway does.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cortex.blockkeys import chain_keys, root_key
from cortex.config import CortexConfig
from cortex.errors import ClientError
from cortex.model_bundle import ModelBundle, TemplateError
from cortex.piecewise_tokenize import EncoderSet, SegmentMismatch, TokenCursor
from extproc import candidates, pd
from extproc.candidates import Hysteresis
from extproc.cluster_view import ClusterView, TargetInfo
from extproc.policies import Policies
from extproc.policies.base import Decision, Facts
from extproc.predictions import Predictions
from extproc.prompt_walk import DeferredTail, Tail, WalkResult, walk
from extproc.registry import ModelRegistry
from extproc.request import ParsedRequest


@dataclass(slots=True)
class Timings:
    tokenize_s: float = 0.0
    hash_s: float = 0.0
    lookup_s: float = 0.0
    score_s: float = 0.0


@dataclass(slots=True)
class RouteResult:
    decision: Decision
    prompt_tokens: int
    token_ids: list[int] | None
    timings: Timings = field(default_factory=Timings)
    truncated: bool = False
    """The prompt was longer than extproc.max_tokenize_chars; prompt_tokens counts only the routed prefix."""
    model: str = ""
    """The configured model that serves it (differs from the request's when an alias was used)."""
    alias: str | None = None
    """The public name the client used, when it was an alias."""
    lora: str | None = None
    """The LoRA adapter whose blocks the prompt was matched against (None: the base model's)."""
    pd: pd.PdPlan | None = None
    """Set when the model has a PD pool: the pair (prefill and decode decisions) or why the request skips it."""
    prompt_tokens_estimated: bool = False
    """Routing stopped before the end of the prompt (token_ids is None): prompt_tokens is an estimate."""


@dataclass(slots=True)
class Prepared:
    """The prompt as routing sees it, computed once per request whatever pools then compete for it."""

    model: str
    alias: str | None
    workers: list[TargetInfo]
    ids: list[int]
    truncated: bool
    """The prompt was longer than extproc.max_tokenize_chars; prompt_tokens counts only the routed prefix."""
    keys: list[int]
    matches: np.ndarray | None
    why: str
    timings: Timings
    body: dict[str, Any] | None = None
    prompt_tokens: int = 0
    walked: bool = False
    """Tokenized only as far as routing needed (extproc/prompt_walk.py): `ids` is empty, `prompt_tokens` may be an
    estimate, and `tail` holds the rest, to become the chosen targets' predictions after the answer."""
    estimated: bool = False
    tail: Tail | None = None
    pools: pd.Pools | None = None
    """The model's workers by PD role (None in transparent mode, where roles are not Cortex's to use)."""
    lora: str | None = None


class Router:
    def __init__(self, cfg: CortexConfig, cluster: ClusterView, registry: ModelRegistry) -> None:
        self.cluster = cluster
        self.predictions = Predictions(cfg.extproc.prediction_ttl_s)
        # Prompt tails past the first block no worker holds, finished into predictions after the answer.
        self.deferred = DeferredTail(self.predictions)
        # Per tokenizer: the text between special tokens encoded piece by piece with a cache, checked once.
        self.segments = EncoderSet()
        self.reload(cfg, registry)
        self.hysteresis = Hysteresis()
        self.policies = Policies()
        self.rng = random.Random()
        """Every random draw of a decision (ties, p2c, cold-start share): deterministic given its seed."""

    def reload(self, cfg: CortexConfig, registry: ModelRegistry) -> None:
        """Swap in a new config and registry (built off the request path): the next request uses them."""
        self.cfg = cfg
        self.registry = registry
        self.bundles = registry.bundles
        # Encoders (and their warm caches) are kept for tokenizers still in use; new ones are checked here.
        self.segments.update(registry.bundles.values())
        self.predictions.ttl_s = cfg.extproc.prediction_ttl_s

    def tokens(self, req: ParsedRequest, bundle: ModelBundle) -> tuple[list[int], bool]:
        """The prompt's token ids, and whether they were cut short for routing.

        Routing needs the prefix a cache can hold, not a prompt longer than any context window: text past
        `max_tokenize_chars` is not tokenized. The tokens at the cut may differ from the engine's, so one
        block more is dropped; a wrong token there could only turn a hit into a miss, never the reverse.
        Pieces between special tokens seen before (system prompt, earlier turns) come from a cache.
        """
        if req.prompt_ids is not None:
            return req.prompt_ids, False
        seg = self.segments.get(bundle)
        text, special = self._text(req, bundle)
        cap = self.cfg.extproc.max_tokenize_chars
        if len(text) <= cap:
            return seg.encode(text, add_special_tokens=special), False
        ids = seg.encode(text[:cap], add_special_tokens=special)
        return ids[: max(0, len(ids) - 2 * self.cluster.block_size)], True

    def _text(self, req: ParsedRequest, bundle: ModelBundle) -> tuple[str, bool]:
        """The prompt as text, and whether the tokenizer adds its special tokens (completions) or not (chat)."""
        try:
            if req.kind == "chat":
                assert req.messages is not None
                text = bundle.render_chat(req.messages, tools=req.tools,
                                          add_generation_prompt=req.add_generation_prompt,
                                          continue_final_message=req.continue_final_message,
                                          chat_template_kwargs=req.chat_template_kwargs)
                special = False
            else:
                assert req.prompt_text is not None
                text, special = req.prompt_text, True
        except TemplateError as exc:
            raise ClientError(400, str(exc), "messages") from None
        return text, special

    def _walk(self, req: ParsedRequest, bundle: ModelBundle, workers: list[TargetInfo], root: int,
              timings: Timings) -> tuple[WalkResult, bool]:
        """Tokenize, hash and look up only as far as some worker can hold the prompt (extproc/prompt_walk.py)."""
        t0 = time.perf_counter()
        bs = self.cluster.block_size
        truncated = False
        if req.prompt_ids is not None:
            ids = req.prompt_ids
            cursor = TokenCursor.of_ids(ids)

            def whole() -> list[int]:
                return ids
        else:
            text, special = self._text(req, bundle)
            cap = self.cfg.extproc.max_tokenize_chars
            if len(text) > cap:
                text, truncated = text[:cap], True
            cursor = self.segments.get(bundle).cursor(text, add_special_tokens=special)

            def whole() -> list[int]:
                return bundle.tokenizer.encode(text, add_special_tokens=special).ids
        timings.tokenize_s += time.perf_counter() - t0
        watched = [w.slot for w in workers]
        trusted = [w.slot for w in workers if w.exact_kv]

        def go(cursor: TokenCursor) -> WalkResult:
            # Past a cut the last tokens may differ from the engine's: two more blocks are left out, as in tokens().
            return walk(cursor, block_size=bs, root=root, holdback=1 + 2 * bs * truncated, lookup=self.cluster.match,
                        predictions=self.predictions, watched=watched, trusted=trusted, timings=timings,
                        catch_up=self.deferred.catch_up, whole=whole)
        try:
            result = go(cursor)
        except SegmentMismatch:
            # Where encode() falls back to whole-text ids for this prompt, the walk starts over with them.
            t1 = time.perf_counter()
            cursor = TokenCursor.of_ids(whole())
            timings.tokenize_s += time.perf_counter() - t1
            result = go(cursor)
        if truncated:
            result.prompt_tokens = max(0, result.prompt_tokens - 2 * bs)
        return result, truncated

    def prepare(self, req: ParsedRequest, *, full_tokens: bool = False) -> Prepared:
        """Everything about the prompt that does not depend on which pool serves it: model, tokens, keys, and
        how many leading blocks each routing target holds.

        Unless `full_tokens`, tokenizing, hashing and lookup stop at the first block no worker holds or is
        predicted to hold: every target's match is the same as with the whole prompt. A model with a PD pool
        ready gets the whole prompt, since its skip rule needs the exact prompt length.
        """
        resolved = self.registry.resolve(req.model, lambda m: bool(self.cluster.candidates(m)),
                                         lora_path=req.lora_path)
        # The chain starts where the engine's does: an adapter's blocks and a salted prompt's blocks are their own
        # namespaces, keyed by the ledger from the adapter name and salt the engine publishes with them.
        root = root_key(resolved.lora, req.cache_salt)
        bundle = self.bundles[resolved.model]
        workers = self.cluster.candidates(resolved.model)
        if not workers:
            raise ClientError(503, f"no healthy worker serves model `{req.model}`", "model")
        timings = Timings()
        model_cfg = self.cfg.model(resolved.model)
        transparent = model_cfg is not None and model_cfg.scheduling == "transparent"
        pools = None if transparent else pd.split_pools(workers)
        if not (full_tokens or pools is None or req.unroutable or not self.cluster.alive or pools.pd_ready):
            walked, truncated = self._walk(req, bundle, workers, root, timings)
            why = "no_cached_prefix"
            if not walked.keys:
                why = "prompt_shorter_than_a_block"
            elif walked.matches is None:
                why = "ledger_unavailable"
            return Prepared(model=resolved.model, alias=resolved.alias, workers=workers, ids=[], truncated=truncated,
                            keys=walked.keys, matches=walked.matches, why=why, timings=timings, body=req.body,
                            prompt_tokens=walked.prompt_tokens, walked=True, estimated=walked.estimated,
                            tail=walked.tail, pools=pools, lora=resolved.lora)
        t0 = time.perf_counter()
        ids, truncated = self.tokens(req, bundle)
        t1 = time.perf_counter()
        timings.tokenize_s = t1 - t0
        bs = self.cluster.block_size
        # An engine always computes at least the last prompt token, so a hit never covers it.
        usable_blocks = max(0, (len(ids) - 1) // bs)
        why = "no_cached_prefix"
        matches = None
        keys: list[int] = []
        if transparent:
            why = "transparent_proxy"
        elif req.unroutable:
            why = req.unroutable
        elif not self.cluster.alive:
            why = "ledger_unavailable"
        elif usable_blocks == 0:
            why = "prompt_shorter_than_a_block"
        else:
            keys = chain_keys(ids, bs, root, max_blocks=usable_blocks)
            t2 = time.perf_counter()
            timings.hash_s = t2 - t1
            matches = self.cluster.match(keys)
            timings.lookup_s = time.perf_counter() - t2
            if matches is None:
                why = "ledger_unavailable"
        return Prepared(model=resolved.model, alias=resolved.alias, workers=workers, ids=ids, truncated=truncated,
                        keys=keys, matches=matches, why=why, timings=timings,
                        body=req.body, prompt_tokens=len(ids), pools=pools, lora=resolved.lora)

    def choose(self, prep: Prepared, workers: Sequence[TargetInfo], *, commit: bool) -> Decision:
        """One pool's decision for a prepared prompt (a pool whose workers publish no events simply holds
        nothing in the ledger, so it is chosen by load)."""
        t3 = time.perf_counter()
        matches, keys = prep.matches, prep.keys
        scoring = self.cfg.scheduler
        cands = candidates.build(workers, matches=matches, keys=keys, inflight=self.cluster.inflight.totals(),
                                 alive=self.cluster.alive, predictions=self.predictions,
                                 hysteresis=self.hysteresis, scoring=scoring)
        facts = Facts(block_size=self.cluster.block_size, ledger_usable=matches is not None,
                      why_not_exact=candidates.why_not_exact(prep.why, workers, matches, cands), scoring=scoring,
                      home=keys[0] if keys and scoring.prompt_home else None)
        model_cfg = self.cfg.model(prep.model)
        transparent = model_cfg is not None and model_cfg.scheduling == "transparent"
        policy = self.policies.select(cands, transparent=transparent, alive=self.cluster.alive,
                                      ledger_usable=matches is not None)
        decision = policy.decide(cands, facts, self.rng)
        prep.timings.score_s += time.perf_counter() - t3
        if commit and keys and decision.chosen.ledger_trusted:
            self.predictions.record(decision.chosen.slot, keys)
            if prep.tail is not None and not prep.tail.done:
                # The rest of the prompt becomes this target's predictions after the answer.
                prep.tail.slot = decision.chosen.slot
                self.deferred.submit(prep.tail)
        return decision

    def route_any(self) -> Decision | None:
        """A request that is no inference: the least loaded worker of the whole fleet (None: there is none)."""
        cands = candidates.whole_workers(self.cluster.all_candidates(), inflight=self.cluster.inflight.totals(),
                                         alive=self.cluster.alive)
        if not cands:
            return None
        facts = Facts(block_size=self.cluster.block_size, ledger_usable=False,
                      why_not_exact="not_an_inference_request", scoring=self.cfg.scheduler)
        return self.policies.load_aware.decide(cands, facts, self.rng)

    def route(self, req: ParsedRequest, *, commit: bool = True, full_tokens: bool | None = None) -> RouteResult:
        """Decide. `commit` records the chosen target's coming blocks as predicted (real traffic only).

        Real traffic stops tokenizing, hashing and looking up at the first block no worker holds or is
        predicted to hold; the decision is the same as with the whole prompt, prompt_tokens is then estimated
        and the rest becomes predictions after the answer. `full_tokens` (default: when not committing, as the
        explain endpoint does) computes the whole prompt and returns its token ids.
        """
        prep = self.prepare(req, full_tokens=not commit if full_tokens is None else full_tokens)
        pools = prep.pools
        pd_plan = pd.plan(prep, pools, self, commit=commit) if pools is not None and pools.pd_ready else None
        if pd_plan is not None and pd_plan.pair is not None:
            decision = pd_plan.pair.decode
        else:
            # No pair: the workers that serve a request alone (all of them in transparent mode).
            workers = prep.workers if pools is None else pools.single
            if not workers:
                assert pools is not None  # prepare() refused a model without healthy workers
                raise ClientError(503, pd.no_pool_message(prep.model, pools), "model")
            decision = self.choose(prep, workers, commit=commit)
        return RouteResult(decision=decision, prompt_tokens=prep.prompt_tokens,
                           token_ids=None if prep.walked else prep.ids, timings=prep.timings,
                           truncated=prep.truncated, model=prep.model, alias=prep.alias, lora=prep.lora, pd=pd_plan,
                           prompt_tokens_estimated=prep.estimated)
