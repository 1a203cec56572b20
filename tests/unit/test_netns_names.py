"""Which process owns a namespace or link, from its name (infra/netns.py)."""

from __future__ import annotations

import pytest

from ferry.infra import netns


@pytest.mark.parametrize(
    ("name", "owner"),
    [
        ("ferry-123-h0", 123),
        ("ferry-4194304-h12", 4194304),
        ("fb123", 123),
        ("fv123h4", 123),
        ("ifb0", None),  # the kernel's, and others' names, are never touched
        ("eth0", None),
        ("fbx", None),
        ("ferry-abc-h0", None),
        ("fv123", 123),
    ],
)
def test_owner_of_a_name(name: str, owner: int | None) -> None:
    assert netns._owner(name) == owner


def test_hosts_needs_at_least_one() -> None:
    with pytest.raises(ValueError, match="hosts must be >= 1"):
        netns.Hosts(0)
