"""Responses API ids that say which worker holds the response, so a follow-up naming it goes there.

An engine that stores responses (vLLM with VLLM_ENABLE_RESPONSES_API_STORE=1, SGLang) keeps them in its own API
server's memory: a request with `previous_response_id` is served only by the worker that answered the previous
one (any other answers 404), and that worker also holds the conversation's KV blocks. vLLM takes the response's id
from the request's `request_id` field when the client sets one (vllm/entrypoints/openai/responses/protocol.py:
ResponsesRequest.request_id), so Cortex learns nothing after the fact: it names the response itself, before
sending it, as `resp_cx<tag><random>`, where the tag is a hash of the chosen worker's address. Any extproc process
of any replica reads the worker back from the id alone, with no shared state, and a follow-up goes to that
worker (`pin`), ahead of whatever the policy chose. The tag is a hash, so a client learns only whether two of its
responses came from one worker.

Limits, by design: a client that sets its own request_id keeps it (its follow-ups are routed as any request); a
response Envoy retried on another worker (the first failed before answering) is tagged with the first; a worker
that left the model or is unhealthy is not pinned to (the policy's choice stands, and the engine answers 404
as it would for a response it lost in a restart).
"""

from __future__ import annotations

import random

import xxhash

from extproc.policies.base import LOAD_AWARE, Decision

PREFIX = "resp_cx"
RESPONSES_PREFIX = "/v1/responses/"
TAG_CHARS = 16
REASON = "previous_response"


def tag(address: str) -> str:
    """The worker's tag: 16 hex digits of XXH3-64 of its address (ip:port), the API server that stores responses."""
    return xxhash.xxh3_64_hexdigest(address.encode())


def mint(address: str, rng: random.Random) -> str:
    """A new response id naming the worker at `address` (128 random bits after the tag)."""
    return f"{PREFIX}{tag(address)}{rng.getrandbits(128):032x}"


def tag_of(response_id: str | None) -> str | None:
    """The worker tag a response id carries (None: not an id Cortex minted)."""
    if response_id is None or not response_id.startswith(PREFIX) or len(response_id) != len(PREFIX) + TAG_CHARS + 32:
        return None
    found = response_id[len(PREFIX):len(PREFIX) + TAG_CHARS]
    return found if all(c in "0123456789abcdef" for c in found) else None


def in_path(path: str) -> str | None:
    """The response id a stored-response path names (`GET`/`DELETE /v1/responses/{id}`, `POST .../cancel`,
    `GET .../input_items`): those reach only the worker that stores it, like a follow-up."""
    rest = path.removeprefix(RESPONSES_PREFIX)
    if rest == path or not rest:
        return None
    return rest.split("/", 1)[0] or None


def pin(decision: Decision, worker_tag: str | None) -> Decision:
    """The decision with the worker that holds the previous response first (its other candidates, then the
    policy's order, as retry targets); unchanged when no candidate is that worker."""
    if worker_tag is None:
        return decision
    holders = [c for c in decision.order if tag(c.address) == worker_tag]
    if not holders:
        return decision
    order = (*holders, *(c for c in decision.order if tag(c.address) != worker_tag))
    return Decision(order, LOAD_AWARE, REASON, hit_tokens=0, matched_tokens=decision.matched_tokens,
                    estimates=decision.estimates)
