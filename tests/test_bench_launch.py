"""cortexbench/launch.py's port picking, as parallel test workers share it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from cortexbench import launch


@pytest.fixture
def shared() -> Iterator[None]:
    before = launch._share
    yield
    launch._share = before


@pytest.mark.parametrize("index", [0, 1])
def test_a_worker_takes_ports_only_from_its_own_blocks(shared: None, index: int) -> None:
    launch.share_ports(index, 2)
    ports = launch.free_ports(40)
    assert len(set(ports)) == 40
    assert {(p // launch.PORT_BLOCK) % 2 for p in ports} == {index}


def test_a_share_outside_the_count_is_refused(shared: None) -> None:
    with pytest.raises(ValueError, match="port share 2 of 2"):
        launch.share_ports(2, 2)
