"""One simulated SGLang server's PD leg (``--role prefill|decode``): what each leg does before its request runs.

Both legs need ``bootstrap_room``. A prefill waits in its bootstrap queue for the room's decode, prefills, answers
one token and hands the decode the prompt length and its cached-token count; a decode fetches that from
``bootstrap_host:bootstrap_port`` (the port falling back to its own ``--disaggregation-bootstrap-port``), skips the
prefill and reports the prefill's cached tokens, or fails after the waiting timeout. The rendezvous and the
prefill's bootstrap server are cortexsim/pd.py's; the HTTP surface around a leg is cortexsim/sglang_api.py's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from cortexsim.config import SimConfig
from cortexsim.engine import EngineCore, SimRequest
from cortexsim.faults import Faults
from cortexsim.openai_api import ApiError, Prepared
from cortexsim.pd import FAKE_BOOTSTRAP_HOST, Rooms, TransferError, fetch_kv

DISAGGREGATION_MODES = {"both": "null", "prefill": "prefill", "decode": "decode"}
"""SGLang's `disaggregation_mode` for each simulator role."""


class SglangPd:
    """A server's PD leg, and the per-DP-rank queue and failure counts SGLang reports for it (/metrics,
    /v1/loads). With role `both` it prepares nothing."""

    def __init__(self, config: SimConfig, rooms: Rooms | None, faults: Faults, ranks: int) -> None:
        self.config = config
        self.rooms = rooms
        self.faults = faults
        self.bootstrap_waiting = [0] * ranks
        self.transfer_waiting = [0] * ranks
        self.bootstrap_failed = [0] * ranks
        self.transfer_failed = [0] * ranks

    def _room(self, body: Mapping[str, Any]) -> int:
        room = body.get("bootstrap_room")
        if isinstance(room, list) and len(room) == 1:
            room = room[0]
        if isinstance(room, bool) or not isinstance(room, int):
            raise ApiError(400, f"this is a PD {self.config.role} server: requests need an integer "
                                "bootstrap_room; send them through a PD router")
        return room

    async def prepare(self, body: Mapping[str, Any], prompt: list[int], engine: EngineCore) -> Prepared:
        role = self.config.role
        if role == "prefill":
            assert self.rooms is not None
            room = self._room(body)
            self.bootstrap_waiting[engine.rank] += 1
            try:
                arrived = await self.rooms.wait_for_decode(room, self.config.bootstrap_timeout)
            except asyncio.CancelledError:
                self.rooms.fail(room, "the prefill request was aborted")  # its decode must not wait for it
                raise
            finally:
                self.bootstrap_waiting[engine.rank] -= 1
            if not arrived:
                self.bootstrap_failed[engine.rank] += 1
                raise ApiError(500, f"Request with bootstrap_room={room} timed out after "
                                    f"{self.config.bootstrap_timeout}s in KVPoll.Bootstrapping")
            # A prefill server computes the prompt and samples exactly one token, whatever max_tokens says.
            return Prepared(max_tokens=1, extra={"room": room})
        if role == "decode":
            room = self._room(body)
            host = body.get("bootstrap_host")
            if isinstance(host, list) and len(host) == 1:
                host = host[0]
            if host == FAKE_BOOTSTRAP_HOST:
                return Prepared(num_external_tokens=len(prompt), reported_cached_tokens=0)
            if not isinstance(host, str) or not host:
                raise ApiError(400, "bootstrap_host is required on a PD decode server")
            port = body.get("bootstrap_port")
            if isinstance(port, list) and len(port) == 1:
                port = port[0]
            if port is None:
                port = self.config.bootstrap_port
            if port is None:
                raise ApiError(400, "bootstrap_port is required on a PD decode server")
            self.transfer_waiting[engine.rank] += 1
            try:
                if self.faults.get("pd_stall_bootstrap"):
                    # Fault: this decode never reaches its prefill's bootstrap server; it waits out its timeout.
                    await asyncio.sleep(self.config.waiting_timeout)
                    raise TransferError("transfer", f"no KV for bootstrap_room={room} within "
                                                    f"{self.config.waiting_timeout}s (waiting timeout)")
                info = await fetch_kv(host, int(port), room, self.config.waiting_timeout)
            except TransferError as exc:
                counters = self.bootstrap_failed if exc.phase == "handshake" else self.transfer_failed
                counters[engine.rank] += 1
                raise ApiError(500, f"Decode {exc.phase} failed for request rank={engine.rank} "
                                    f"bootstrap_room={room}: {exc}") from None
            finally:
                self.transfer_waiting[engine.rank] -= 1
            return Prepared(num_external_tokens=len(prompt), reported_cached_tokens=int(info["cached_tokens"]))
        return Prepared()

    def finished(self, req: SimRequest, prepared: Prepared) -> None:
        """A prefill's request is done: its room's decode learns what it needs to continue."""
        if self.config.role == "prefill" and prepared.extra is not None and self.rooms is not None:
            self.rooms.complete(prepared.extra["room"], {"num_tokens": len(req.prompt_token_ids),
                                                         "cached_tokens": req.num_cached_tokens})

    def released(self, prepared: Prepared) -> None:
        """A request left the server, done or not."""
        if self.config.role == "prefill" and prepared.extra is not None and self.rooms is not None:
            # No-op after complete(); otherwise the waiting decode learns that its prefill died.
            self.rooms.fail(prepared.extra["room"], "the prefill request was aborted")
