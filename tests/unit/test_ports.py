import socket

import pytest

from ferry.infra import ports


def test_picks_are_below_the_ephemeral_range_distinct_and_bindable() -> None:
    low, _ = ports.ephemeral_range()
    picked = [ports.free_port() for _ in range(50)]
    assert len(set(picked)) == len(picked)
    for port in picked:
        assert ports.PICK_FLOOR <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_or_given_before_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    given = ports.free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        spare = next(
            p
            for p in range(ports.PICK_FLOOR, 30000)
            if p not in ports._given and p != busy and ports._bindable("127.0.0.1", p)
        )
        tries = iter([busy, given, spare])
        monkeypatch.setattr(ports.random, "randrange", lambda *_: next(tries))
        assert ports.free_port() == spare


def test_no_room_below_the_range_falls_back_to_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (ports.PICK_FLOOR + 10, 60999))
    picked = {ports.free_port() for _ in range(10)}
    assert len(picked) == 10
    assert all(p >= ports.PICK_FLOOR + 10 for p in picked)


def test_ferry_ups_fixed_ports_are_never_handed_to_its_children(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The gateway binds its port only once the workers serve: a worker's port picked meanwhile
    must not be that one (a gateway that then exits 2 was seen in CI)."""
    from ferry.infra.launcher import ClusterSpec, Launcher

    free = (
        p
        for p in range(ports.PICK_FLOOR, 30000)
        if p not in ports._given and ports._bindable("127.0.0.1", p)
    )
    gateway, grpc_api, scheduler, spare = next(free), next(free), next(free), next(free)
    Launcher(ClusterSpec(gateway_port=gateway, grpc_port=grpc_api, scheduler_port=scheduler))
    tries = iter([gateway, grpc_api, scheduler, spare])
    monkeypatch.setattr(ports.random, "randrange", lambda *_: next(tries))
    assert ports.free_port() == spare
