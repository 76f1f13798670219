"""The `cortex` command."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

from cortex import grpc_runtime, logs
from cortex.config import ConfigError, CortexConfig, dump_config, load_config

USAGE = """cortex <command> [options]

commands:
  run      -c cortex.yaml   start the gateway (Envoy + ingest + extproc) for the configured workers
  epp      -c cortex.yaml   start the endpoint picker (ingest + extproc, no Envoy) for a Gateway API Inference
                            Extension gateway (docs/deployment.md#epp)
  demo                      start simulated workers and a gateway in front of them, print what to curl
  sim      [flags]          run one simulated engine (see `cortex sim --help`)
  bench    [flags]          benchmark Cortex against other routers on simulated workers (`cortex bench --help`)
  capacity [flags]          KV memory per worker and the max_concurrent to set (`cortex capacity --help`)
  check    -c cortex.yaml   validate a config file and its model files, print it with every default filled in
  envoy-config -c cortex.yaml  print the Envoy bootstrap Cortex generates from a config
  hash-key                  read an API key from stdin, print the digest to list in tenants[].api_keys
  ingest / extproc / observe  internal: the processes `cortex run` supervises

logs (run, epp, demo, sim, ingest, extproc, observe):
  --log-format text|json    text: readable lines; json: one JSON object per line (default: log.format in
                            cortex.yaml, else text)
  --log-level debug|info|warning|error   (default: log.level in cortex.yaml, else info; -v is debug)
"""


def _load(path: str) -> CortexConfig:
    try:
        return load_config(path)
    except ConfigError as exc:
        logs.fatal(str(exc))
        raise SystemExit(2) from None


def _models_ok(cfg: CortexConfig) -> bool:
    """Every model's files load and work; otherwise one line naming the model and the path."""
    from cortex.config import check_models
    from cortex.model_bundle import BundleError

    try:
        check_models(cfg)
    except BundleError as exc:
        logs.fatal(str(exc))
        return False
    return True


def _hash_key() -> int:
    """The key comes from stdin, never the command line (which other users of the machine can read)."""
    import getpass

    from extproc.tenants import digest

    key = getpass.getpass("API key: ") if sys.stdin.isatty() else sys.stdin.readline()
    key = key.strip()
    if not key:
        logs.fatal("hash-key: no key on stdin (e.g. `printf %s \"$KEY\" | cortex hash-key`)")
        return 2
    print(digest(key))
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:
        # The reader left (`cortex envoy-config ... | head`): nothing more to say, and no traceback. Python flushes
        # stdout again at exit, so it is pointed at /dev/null first.
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    # Before anything imports grpc: its C core reads these settings once (cortex/grpc_runtime.py).
    grpc_runtime.configure()
    if command == "sim":
        from cortexsim.cli import main as sim_main

        return sim_main(rest)
    if command == "bench":
        from cortexbench.cli import main as bench_main

        return bench_main(rest)
    if command == "capacity":
        from cortexbench.capacity.cli import main as capacity_main

        return capacity_main(rest)
    if command == "hash-key":
        return _hash_key()
    if command == "demo":
        from cortexctl.demo import main as demo_main

        return demo_main(rest)
    parser = argparse.ArgumentParser(prog=f"cortex {command}")
    parser.add_argument("-c", "--config", required=True, help="path to cortex.yaml")
    parser.add_argument("-v", "--verbose", action="store_true", help="same as --log-level debug")
    logs.add_flags(parser)
    if command == "extproc":
        parser.add_argument("--index", type=int, default=0)
    if command in ("extproc", "ingest"):
        parser.add_argument("--picker", action="store_true",
                            help="as `cortex epp` runs it: the endpoint picker of a gateway Cortex did not configure")
    if command == "run":
        parser.add_argument("--reset-workers", action="store_true",
                            help="forget the workers added or removed through the admin API (runtime_dir/workers.json)")
    args = parser.parse_args(rest)
    process = f"extproc-{args.index}" if command == "extproc" else "supervisor" if command in ("run", "epp") \
        else command
    # The flags alone first, so a refused config is reported in the format asked for; then the file's `log`.
    logs.configure(*logs.resolve(args.log_level, args.log_format, args.verbose), process=process)
    cfg = _load(args.config)
    logs.configure(*logs.resolve(args.log_level, args.log_format, args.verbose, cfg.log.level, cfg.log.format),
                   process=process)
    if command == "check":
        if not _models_ok(cfg):
            return 2
        print(dump_config(cfg), end="")
        return 0
    if command == "envoy-config":
        import yaml

        from cortex.envoy_config import bootstrap

        print(yaml.safe_dump(bootstrap(cfg), sort_keys=False), end="")
        return 0
    if command == "run":
        from cortexctl.gateway import reset_workers, run_gateway

        if args.reset_workers:
            reset_workers(cfg)
        return run_gateway(cfg, Path(args.config).resolve())
    if command == "epp":
        from cortexctl.gateway import run_picker

        return run_picker(cfg, Path(args.config).resolve())
    if command == "ingest":
        from ingest.main import run

        return run(cfg, Path(args.config), picker=args.picker)
    if command == "extproc":
        from extproc.serve import run as run_extproc

        return run_extproc(cfg, args.index, Path(args.config), picker=args.picker)
    if command == "observe":
        from observe.service import run as run_observe

        return run_observe(cfg)
    print(f"cortex: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
