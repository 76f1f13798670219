"""Several extproc processes (the default is one per core): Envoy spreads streams over them, and they share
the ledger view and in-flight counts, so routing stays exact whichever process decides."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest

from tests.harness import Gateway, cluster, long_chat
from tests.test_gateway import chat

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with cluster(tmp_path_factory.mktemp("multi"), extproc_processes=2) as g:
        yield g


def test_two_processes_share_the_ledger(gw: Gateway) -> None:
    assert len(gw.child_pids("cortex.cli extproc")) == 2
    messages = long_chat(800, seed=77)
    first, _ = chat(gw, messages)
    holder = first["x-cortex-assigned-worker"]
    for _ in range(12):
        h, usage = chat(gw, messages)
        why = (h["x-cortex-match-mode"], h["x-cortex-route-reason"])
        assert h["x-cortex-assigned-worker"] == holder and h["x-cortex-match-mode"] == "exact_kv_events", why
        assert int(h["x-cortex-cache-hit-tokens"]) == usage["prompt_tokens_details"]["cached_tokens"]
    # Envoy's ext_proc cluster lists both processes and both carried streams.
    clusters = httpx.get(f"http://127.0.0.1:{gw.admin_port}/clusters", timeout=10).text
    totals = [int(n) for n in re.findall(r"^cortex_extproc::127\.0\.0\.1:\d+::rq_total::(\d+)$", clusters, re.M)]
    assert len(totals) == 2 and all(n > 0 for n in totals), totals
    assert {p.name for p in (gw.root / "rt" / "inflight").glob("*.bin")} == {"0.bin", "1.bin"}
