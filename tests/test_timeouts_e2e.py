"""A long silent prefill is not a stalled stream: through the real Envoy, with a stream idle timeout far shorter
than a simulated worker's prefill, requests complete. The negative control sets a routed idle timeout as short:
the same request is then cut, which shows the test can see a cut and that Cortex's route setting is what saves it.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import orjson
import pytest

from tests.harness import MODEL, cluster, long_chat

pytestmark = pytest.mark.timeout(240)

# ~800 prompt tokens at 4 ms each: a prefill of about 3 s that sends nothing, against idle timeouts of 1 s.
PREFILL = ("--prefill-ms-per-token", "4")
IDLE_S = 1.0


def ask(url: str, seed: int, stream: bool) -> tuple[int, dict | None]:
    """Status and usage of one request (usage None when the stream was cut before it ended)."""
    body = {"model": MODEL, "messages": long_chat(600, seed=seed), "max_tokens": 4}
    if not stream:
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        return r.status_code, r.json().get("usage") if r.status_code == 200 else None
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    usage = None
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = orjson.loads(line[6:])
                    usage = chunk.get("usage") or usage
            return r.status_code, usage
    except httpx.HTTPError:  # a cut stream (reset mid-body)
        return 0, None


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_silent_prefill_longer_than_the_stream_idle_timeout_completes(tmp_path: Path, stream: bool) -> None:
    with cluster(tmp_path, n_sims=1, sim_args=PREFILL, extra_config={"timeouts": {"stream_idle_s": IDLE_S}}) as gw:
        for seed in (1, 2):  # a new prompt each time: nothing cached, the whole prefill runs
            status, usage = ask(gw.url, 900 + seed + 10 * stream, stream)
            assert status == 200 and usage is not None and usage["prompt_tokens"] > 700
            assert usage["prompt_tokens"] * 4 / 1000 > 2 * IDLE_S  # the prefill alone outlasted the timeout


def test_a_routed_idle_timeout_shorter_than_the_prefill_cuts_it(tmp_path: Path) -> None:
    cfg = {"timeouts": {"stream_idle_s": IDLE_S, "routed_idle_s": IDLE_S}}
    with cluster(tmp_path, n_sims=1, sim_args=PREFILL, extra_config=cfg) as gw:
        status, usage = ask(gw.url, 950, stream=False)
        assert status == 504 and usage is None
