"""The real-engine tier: every test here runs against real vLLM engines (tests/real_engine/vllm_engine.py).

Without the vLLM venv the tier skips with the reason, so the ordinary tests never depend on a 3 GB install;
with `CORTEX_REAL_ENGINE=required` (CI's .ci/run) a missing engine fails instead.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.real_engine import models
from tests.real_engine.vllm_engine import SETUP_WAIT_S, await_setup, required, venv_missing


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    tier = [item for item in items if here in Path(item.path).parents]
    for item in tier:
        item.add_marker(pytest.mark.real_engine)
    if tier and os.environ.get("CORTEX_VLLM_SETUP_STATUS"):
        # The tier runs in collection order on one worker (tests/conftest.py), so its first test is the one that
        # waits for an install running beside the suite: its timeout has room for that wait too.
        first = tier[0]
        marker = first.get_closest_marker("timeout")
        own = float(marker.args[0]) if marker is not None and marker.args else config.getini("timeout")
        first.add_marker(pytest.mark.timeout(float(own or 0) + SETUP_WAIT_S))


@pytest.fixture(scope="session")
def vllm_available() -> None:
    """Skips (or, when required, fails) the test when no real vLLM can run here."""
    reason = await_setup() or venv_missing()
    if reason is None:
        return
    if required():
        pytest.fail(f"CORTEX_REAL_ENGINE=required but {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def qwen2_tiny(model_root: Path) -> Path:
    return models.qwen2_tiny(model_root)


@pytest.fixture(scope="session")
def gemma3_hybrid(model_root: Path) -> Path:
    return models.gemma3_hybrid(model_root)


@pytest.fixture(scope="session")
def qwen2_vl_tiny(model_root: Path) -> Path:
    return models.qwen2_vl_tiny(model_root)
