"""Tenants' caches kept apart, and Cortex's routing facts shown only to tenants allowed to see them.

A prompt's KV blocks are shared by every request whose block hashes agree, and both engines fold a per-request
cache salt into those hashes. Cortex gives every request of an isolated tenant its tenant's salt (its
`shared_prefix_group`'s, for tenants that trust each other), so a tenant can never hit, and so never time or
count, another tenant's cached prompt. The salt also seeds Cortex's own block keys (extproc/prepare.py:
`root_key(lora, req.cache_salt)`), and both engines publish it with their KV events, so the ledger keys a
salted block exactly as the request is keyed: routing stays exact.

What the engines take (checked in their sources):

* vLLM: the `cache_salt` field of the chat and completion requests
  (vllm/entrypoints/openai/chat_completion/protocol.py, vllm/entrypoints/openai/completion/protocol.py),
  checked by `validate_cache_salt` (vllm/entrypoints/generate/base/protocol.py): a non-empty string of at
  most 128 characters without `@`, `/`, `\\` or NUL, else 400. It enters the first block's hash as
  `("cache_salt", salt)` (vllm/v1/core/kv_cache_utils.py: generate_block_hash_extra_keys), so every later
  block of the chain is salted too; BlockStored events carry the bare salt in block 0's `extra_keys`
  (cortex/engines/vllm.py: event_salt reads it back).
* SGLang: the same field name, `cache_salt: Optional[Union[List[str], str]]` on CompletionRequest and
  ChatCompletionRequest (python/sglang/srt/entrypoints/openai/protocol.py), passed on as
  `GenerateReqInput(cache_salt=request.cache_salt)` (entrypoints/openai/serving_chat.py and
  serving_completions.py). The radix tree's key is (token ids, extra_key, cache_salt), so salted prompts never
  share a node (mem_cache/common.py); its BlockStored events carry `cache_salt` in their own field and the
  published chain starts from SHA-256("sglang-cache-salt-v1\\0" + salt) (cortex/engine_hashes.py:
  sglang_salt_prior; cortex/engines/sglang.py: event_salt). Its protocol model declares no character or
  length rule for the field, so vLLM's is the one both are held to.

The field is the same for both engines, so no engine adapter member is needed. The simulator honours it for
both (cortexsim/vllm_api.py: validate_cache_salt, prefix_cache.py: the salt in block 0's extra keys;
cortexsim/sglang_api.py: _salt, radix_cache.py: the (extra_key, cache_salt) namespace).

The effective salt (`effective_salt`): the tenant's salt alone, or, when the client sent its own cache_salt
(it salts its own users apart inside the tenant), `<tenant salt>:<client salt>`; when that would pass 128
characters, `<tenant salt>~<SHA-256 of the client salt, unpadded base64url>`. Tenant salts are made of
`[A-Za-z0-9._-]` (tenant and group ids) behind a fixed prefix, and `:` and `~` are outside that set, so the
tenant part of an effective salt is always recoverable: no client salt of one tenant can produce another
tenant's effective salt. A tenant salt outside that form (an unconfigured default tenant's id is not
pattern-checked) is replaced by its hash so the result always passes vLLM's rule.
"""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Iterable

import orjson

from cortex.headers import DROPPED_REASON
from extproc.request import ParsedRequest, _cache_salt
from extproc.tenants import Tenant

SALT_MAX = 128
"""vLLM's limit on cache_salt (validate_cache_salt)."""
_HASHED = 43
"""Characters of an unpadded base64url SHA-256 digest."""
_TENANT_PART = re.compile(rf"[A-Za-z0-9._-]{{1,{SALT_MAX - 1 - _HASHED}}}")
CLIENT_SEP = ":"
HASHED_SEP = "~"

_PREFIX = "x-cortex-"


def _digest(value: str) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(value.encode()).digest()).rstrip(b"=").decode()


def effective_salt(tenant_salt: str | None, client_salt: str | None) -> str | None:
    """The cache_salt the engines get for a request: see the module's docstring. `client_salt` is the request's
    own, already held to vLLM's rule (extproc/request.py: _cache_salt); None when it sent none."""
    if tenant_salt is None:
        return client_salt  # not isolated: the client's own salt, or none, as before
    tenant = tenant_salt if _TENANT_PART.fullmatch(tenant_salt) else f"cortex-h-{_digest(tenant_salt)}"
    if client_salt is None:
        return tenant
    combined = f"{tenant}{CLIENT_SEP}{client_salt}"
    return combined if len(combined) <= SALT_MAX else f"{tenant}{HASHED_SEP}{_digest(client_salt)}"


def isolate(req: ParsedRequest, tenant: Tenant | None) -> dict[str, object]:
    """Give the request its effective salt before it is routed (Cortex's keys follow it); the body change that
    carries the salt to every worker that serves it ({} when its tenant is not isolated)."""
    if tenant is None or tenant.salt is None:
        return {}
    if req.cache_salts is not None:  # SGLang's batch form: one salt per prompt, each salted
        salts = [effective_salt(tenant.salt, s) for s in req.cache_salts]
        req.cache_salt = salts[0] if salts else effective_salt(tenant.salt, None)
        return {"cache_salt": salts}
    req.cache_salt = effective_salt(tenant.salt, req.cache_salt)
    return {"cache_salt": req.cache_salt}


def salt_unrouted(raw: bytes, tenant: Tenant | None) -> dict[str, object] | None:
    """A request body Cortex forwards without routing it (any path but the inference paths, e.g. vLLM's
    /inference/v1/generate where a deployment forwards it) may reach the same prefix cache, and those engines
    read `cache_salt` from it too: the body change that salts it like a routed request. None when the tenant is
    not isolated or the body is not a JSON object (no engine reads a salt from it). A client salt that breaks
    vLLM's rule is a ClientError(400), as on the routed paths; SGLang's list form (one per prompt of a batch)
    is salted element by element."""
    if tenant is None or tenant.salt is None:
        return None
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(doc, dict):
        return None
    own = doc.get("cache_salt")
    if isinstance(own, list):
        return {"cache_salt": [effective_salt(tenant.salt, _cache_salt(s)) for s in own]}
    return {"cache_salt": effective_salt(tenant.salt, _cache_salt(own))}


def sees_routing(tenant: Tenant | None) -> bool:
    """May this caller see Cortex's routing headers and call route explain? A hit is a fact about other requests'
    prompts: only tenants marked trusted see it (without tenants configured, the default tenant is trusted).
    An unknown caller sees nothing."""
    return tenant is not None and tenant.trusted


def upstream_cortex_headers(names: Iterable[str]) -> list[str]:
    """The x-cortex-* headers among a worker's response headers: removed for a caller who may not see routing
    facts, since a worker that is itself a gateway (or a sidecar) could send its own. The dropped reason is no
    routing fact: every caller gets it on a refusal (Envoy's local replies pass this way too)."""
    return sorted({n for n in names if n.lower().startswith(_PREFIX) and n.lower() != DROPPED_REASON})
