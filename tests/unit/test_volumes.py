"""Volumes without a mount: leases, the fencing rule, names, and the publish lag."""

from __future__ import annotations

import pytest

from ckptfs import volumes
from ckptfs.backing import LocalBackend
from ckptfs.errors import Fenced, UsageError, VolumeInUse
from ckptfs.publish import COALESCE_S, Lag
from ckptfs.volumes import Lease, VolumeState


def lease(gen: int, base=None) -> Lease:
    return Lease("v", gen, "node", b"\x01" * 16, base, 7, 0)


def test_heads_after_a_takeover_base_are_fenced():
    """Lease 2 took over at head (1, 5): the old holder's later heads are invalid."""
    state = VolumeState("v", [lease(1), lease(2, (1, 5))],
                        [(1, 3), (1, 5), (1, 6), (1, 7), (2, 8)])
    assert [h for h in state.heads if state.valid(h)] == [(1, 3), (1, 5), (2, 8)]
    assert state.newest_valid() == (2, 8)
    assert state.generation == 2 and state.spaces == {7}


def test_a_holder_that_never_published_fences_by_its_base():
    """Lease 3 took over from lease 2's holder before it published anything:
    its base is still a generation 1 head, and it fences what came after."""
    state = VolumeState("v", [lease(1), lease(2, (1, 5)), lease(3, (1, 4))],
                        [(1, 4), (1, 5), (2, 6)])
    assert state.valid_heads() == [(1, 4)]
    assert state.newest_valid() == (1, 4)


def test_a_lease_with_no_base_fences_every_older_head():
    state = VolumeState("v", [lease(1), lease(2, None)], [(1, 1), (1, 2)])
    assert state.valid_heads() == []


def test_lease_round_trip_and_damage():
    raw = volumes.encode_lease(lease(4, (3, 9)))
    assert volumes.decode_lease(volumes.lease_name("v", 4), "v", raw) == lease(4, (3, 9))
    for bad in (raw[:-10], raw.replace(b'"node"', b'"nodf"'), b"[]", b"x" * 70000):
        with pytest.raises(volumes.BadLease):
            volumes.decode_lease(volumes.lease_name("v", 4), "v", bad)
    with pytest.raises(volumes.BadLease, match="generation"):
        volumes.decode_lease(volumes.lease_name("v", 5), "v", raw)
    with pytest.raises(volumes.BadLease, match="volume"):
        volumes.decode_lease(volumes.lease_name("w", 4), "w", raw)


@pytest.mark.parametrize("name", ["", ".", "-x", "a/b", "a b", "x" * 65, "ü"])
def test_bad_volume_names(name):
    with pytest.raises(UsageError):
        volumes.check_name(name)


def test_default_name_is_a_valid_name():
    assert volumes.check_name(volumes.default_name())


def test_take_is_once_per_generation_and_fence(tmp_path):
    store = LocalBackend.create(tmp_path / "s")
    first = volumes.take(store, "v", 1, b"\x01" * 16, None)
    with pytest.raises(VolumeInUse, match="generation 1"):
        volumes.take(store, "v", 1, b"\x02" * 16, None)
    holder = volumes.Volume(store, "v", 1, b"\x01" * 16)
    holder.fence()                                  # nobody newer: fine
    second = volumes.take(store, "v", 2, b"\x02" * 16, (1, 0))
    assert second.space != first.space              # each lease its own pack space
    with pytest.raises(Fenced, match="taken over"):
        holder.fence()
    state = volumes.read_state(store, "v")
    assert [x.gen for x in state.leases] == [1, 2] and state.spaces == {first.space, second.space}
    assert volumes.volume_names(store) == ["v"]


def test_lag_counts_from_the_oldest_unpublished_change():
    lag = Lag()
    assert lag.age_s(100.0) == 0
    lag.durable(1, 10.0)
    lag.durable(2, 20.0)
    assert lag.age_s(25.0) == 15.0
    lag.published(1)                                # a head of state 1: batch 2 waits
    assert lag.age_s(25.0) == 5.0
    lag.published(2)
    assert lag.age_s(25.0) == 0


def test_lag_coalesces_but_never_under_reports():
    lag = Lag()
    lag.durable(1, 10.0)
    lag.durable(2, 10.0 + COALESCE_S / 2)           # folded into the first entry
    lag.published(1)                                # batch 2 still waits: counted from 10
    assert lag.age_s(20.0) == 10.0
    lag.published(2)
    assert lag.age_s(20.0) == 0
