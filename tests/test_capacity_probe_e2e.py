"""`cortex capacity --probe` against a real simulated worker process on loopback.

The worker runs at most 4 requests at once (--max-running 4) and a decode step costs 40 ms, so up to 4
concurrent requests scale (they share decode steps) and an 8th-concurrency step only queues: throughput stays
flat while the queued requests wait ~16 x 40 ms for a slot before their first token. The knee is 4 and the
recommendation 3. A step's time is modelled (slept), so the simulator's own CPU per token is what a loaded machine
can delay: at 20 ms a step, the whole suite beside two CPU hogs once starved it enough at concurrency 4 (throughput
or TTFT) to put the knee at 2; at 40 ms it needs half the CPU share to keep pace. Bounded: four steps of 20
requests of 16 tokens (~30 s), a 90 s budget it does not come near.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator

import pytest

from cortexbench.capacity.cli import main as capacity_main
from tests.harness import PY, stop


@pytest.fixture
def worker() -> Iterator[str]:
    proc = subprocess.Popen([*PY, "sim", "--port", "0", "--kv-events-port", "0", "--worker-id", "capacity-probe",
                             "--max-running", "4", "--decode-ms-per-token", "40"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        assert line.startswith("sim ready"), f"the simulator did not start: {line!r}"
        http = next(part for part in line.split() if part.startswith("http="))
        yield f"http://{http.removeprefix('http=')}"
    finally:
        stop(proc)


def test_probe_finds_the_simulated_knee(worker: str, capsys: pytest.CaptureFixture[str]) -> None:
    # 20 requests a step: the p90 of ~18 steady samples is not one scheduling hiccup of a loaded machine.
    code = capacity_main(["--probe", worker, "--steps", "1,2,4,8", "--requests-per-step", "20", "--max-tokens", "16",
                          "--prompt-tokens", "200", "--duration-s", "90", "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    doc = json.loads(out.out)
    steps = {s["concurrency"]: s for s in doc["steps"]}
    assert list(steps) == [1, 2, 4, 8]
    assert all(s["errors"] == 0 and s["cut_by_deadline"] == 0 for s in steps.values())
    assert [s["requests"] for s in steps.values()] == [20, 20, 20, 20]
    assert doc["requests_sent"] == 80 and doc["model"] == "Qwen/Qwen2.5-7B-Instruct"
    # Up to the worker's 4 slots, concurrency buys throughput; past them it buys only waiting.
    assert steps[4]["output_tokens_per_s"] > 1.5 * steps[1]["output_tokens_per_s"]
    assert steps[8]["ttft_p90_s"] > 2 * steps[4]["ttft_p90_s"]
    assert (doc["knee_concurrency"], doc["knee_found"], doc["recommended_max_concurrent"]) == (4, True, 3)
    assert doc["stopped"] == "stopped at the first step past the knee"


def test_probe_of_an_unreachable_worker_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    from cortexbench.launch import free_ports

    port = free_ports(1)[0]
    code = capacity_main(["--probe", f"http://127.0.0.1:{port}", "--duration-s", "5"])
    err = capsys.readouterr().err
    assert code == 2 and f"cannot reach http://127.0.0.1:{port}" in err and "Traceback" not in err
