"""cortexbench/launch.py's port picking, as parallel test workers share it."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest

from cortexbench import launch


@pytest.fixture
def shared(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    before = launch._share
    # share_ports also writes the variable its children read: restored with the share.
    monkeypatch.setenv(launch.SHARE_ENV, os.environ.get(launch.SHARE_ENV, ""))
    yield
    launch._share = before


@pytest.mark.parametrize("index", [0, 1])
def test_a_worker_takes_ports_only_from_its_own_blocks(shared: None, index: int) -> None:
    launch.share_ports(index, 2)
    ports = launch.free_ports(40)
    assert len(set(ports)) == 40
    assert {(p // launch.PORT_BLOCK) % 2 for p in ports} == {index}


def test_ports_come_from_below_the_ephemeral_range_and_clear_of_the_engines() -> None:
    """Every port-0 bind and outgoing connection on the machine lands in the ephemeral range (the last CI lost a
    demo's port there to another worker's process); real engines take theirs from ENGINE_PORTS."""
    floor = launch._ephemeral_floor()
    ports = launch.free_ports(200) + [launch.free_run(24) + i for i in range(24)]
    assert all(launch.PORT_FLOOR <= p < floor for p in ports)
    assert not [p for p in ports if p in launch.ENGINE_PORTS]


def test_a_run_is_consecutive_free_and_within_one_block(shared: None) -> None:
    launch.share_ports(1, 2)
    for _ in range(50):
        base = launch.free_run(22)
        assert base // launch.PORT_BLOCK == (base + 21) // launch.PORT_BLOCK
        assert (base // launch.PORT_BLOCK) % 2 == 1
        with socket.socket() as s:
            s.bind((launch.HOST, base + 21))


def test_a_port_handed_out_is_not_handed_out_again_while_its_owner_may_still_bind_it() -> None:
    picked = [launch.free_run(3) for _ in range(300)]
    ports = [b + i for b in picked for i in range(3)]
    assert len(set(ports)) == len(ports)


def test_a_share_outside_the_count_is_refused(shared: None) -> None:
    with pytest.raises(ValueError, match="port share 2 of 2"):
        launch.share_ports(2, 2)


def test_a_child_process_picks_in_the_share_of_the_process_that_started_it(shared: None,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A `cortex bench` that a test starts reads the test worker's share from its environment."""
    launch.share_ports(2, 3)
    assert os.environ[launch.SHARE_ENV] == "2/3"
    launch._share = (0, 1)  # as a fresh process starts
    launch._inherited_share()
    assert launch._share == (2, 3)
    assert {(p // launch.PORT_BLOCK) % 3 for p in launch.free_ports(20)} == {2}
    monkeypatch.setenv(launch.SHARE_ENV, "not a share")
    launch._share = (0, 1)
    launch._inherited_share()
    assert launch._share == (0, 1)
