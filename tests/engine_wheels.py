"""The engines' released wheels, fetched at test time and never committed, for tests that run engine code.

Same cache and rules as tests/sim/test_real_engine_decode.py: ``pip download --no-deps`` into
$CORTEX_ENGINE_WHEELS (default ~/.cache/cortex/engine-wheels); where the download is impossible the calling
test skips, and the literal golden vectors elsewhere still pin the bytes. Only single source files are
extracted and run, with the few imported names they need stubbed, in a child interpreter so the stub
packages never shadow anything in the test process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

VLLM = "vllm==0.33.0"
SGLANG = "sglang==0.5.23"
# The engines' KV-event publisher modules and the few names they import, stubbed (kv-events.md §8 C).
PUBLISHER_FILES = {
    "vllm": ["vllm/distributed/kv_events.py", "vllm/config/kv_events.py"],
    "sglang": ["sglang/srt/disaggregation/kv_events.py", "sglang/srt/utils/network.py"],
}
PUBLISHER_STUBS = {
    "vllm/__init__.py": "",
    "vllm/distributed/__init__.py": "",
    "vllm/config/__init__.py": "",
    "vllm/config/utils.py": "from dataclasses import dataclass as config\n",
    "vllm/logger.py": "import logging\ninit_logger = logging.getLogger\n",
    "vllm/utils/__init__.py": "",
    "vllm/utils/network_utils.py": (
        "def get_ip():\n    return '127.0.0.1'\n"
        "def get_tcp_uri(ip, port):\n    return f'tcp://{ip}:{port}'\n"
        "def is_valid_ipv6_address(address):\n    return ':' in address\n"
        "def split_zmq_path(path):\n    scheme, _, rest = path.partition('://')\n"
        "    host, _, port = rest.rpartition(':')\n    return scheme, host, port\n"),
    "vllm/v1/__init__.py": "",
    "vllm/v1/core/__init__.py": "",
    "vllm/v1/core/kv_cache_utils.py": "ExternalBlockHash = bytes | int\n",
    "sglang/__init__.py": "",
    "sglang/srt/__init__.py": "",
    "sglang/srt/disaggregation/__init__.py": "",
    "sglang/srt/utils/__init__.py": "",
    "sglang/srt/runtime_context.py": "def get_parallel():\n    raise RuntimeError('not used by these tests')\n",
}


def cache_dir() -> Path:
    return Path(os.environ.get("CORTEX_ENGINE_WHEELS", Path.home() / ".cache" / "cortex" / "engine-wheels"))


def wheel(spec: str) -> Path:
    name, version = spec.split("==")
    cache = cache_dir()
    found = sorted(cache.glob(f"{name}-{version}-*.whl"))
    if found:
        return found[0]
    cache.mkdir(parents=True, exist_ok=True)
    try:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                               "--dest", str(cache), spec], capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot download {spec}: {exc}")
    found = sorted(cache.glob(f"{name}-{version}-*.whl"))
    if proc.returncode != 0 or not found:
        pytest.skip(f"cannot download {spec}: {proc.stderr.strip()[-300:]}")
    return found[0]


def extract(root: Path, spec: str, members: list[str], stubs: dict[str, str]) -> Path:
    """Copy `members` of the wheel of `spec` under `root`, then write each stub that is not a real file."""
    with zipfile.ZipFile(wheel(spec)) as whl:
        for member in members:
            target = root / member
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(whl.read(member))
    for rel, text in stubs.items():
        target = root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            target.write_text(text)
    return root


def run_child(root: Path, code: str, stdin: str = "", env: dict[str, str] | None = None,
              timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run `code` in a fresh interpreter with `root` first on its path (and this checkout after it)."""
    full = dict(os.environ if env is None else env)
    here = str(Path(__file__).resolve().parents[1])
    full["PYTHONPATH"] = os.pathsep.join([str(root), here])
    proc = subprocess.run([sys.executable, "-c", code], input=stdin, capture_output=True, text=True,
                          timeout=timeout, env=full)
    if proc.returncode != 0:
        raise AssertionError(f"engine code failed:\n{proc.stderr[-3000:]}")
    return proc
