"""Eviction orders of the memory tiers: LRU, and ARC that keeps entries read again through a scan.

Real tiers under a real tiered store (CPU pool, files on disk): what is measured is where keys are held
after a sequence of stores and loads, and which tier served the loads.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import kvmem
from kvmem import blob as blobfmt
from kvmem.errors import ConfigError
from kvmem.stores import CpuTier, GpuTier
from kvmem.stores.eviction import Arc

KIB = 1024
SETTINGS: dict[str, Any] = {
    "cpu_bytes": "256KiB",
    "disk_bytes": "16MiB",
    "fsync": "never",
    "compression": "none",
    "offload_threshold": 1.0,
}


def _blob(elements: int) -> blobfmt.EncodedBlob:
    return blobfmt.encode({"kind": "tensor"}, [torch.zeros(elements, dtype=torch.int32).view(torch.uint8)])


def _value(i: int) -> torch.Tensor:
    return torch.full((4 * KIB,), i, dtype=torch.int32)  # 16 KiB: 16 of them fill the CPU tier


def _hot_after_scan(tmp_path: Path, eviction: str) -> tuple[list[str], float]:
    """Store 6 hot values and read each again, then store 40 values never read (a scan), then read the hot
    ones: where each hot value was held before that last read, and the CPU tier's hits among those reads."""
    with kvmem.Memory(tmp_path / eviction, eviction=eviction, **SETTINGS) as m:
        hot = [f"hot{i}" for i in range(6)]
        for i, key in enumerate(hot):
            m.store(key, _value(i))
        for key in hot:
            m.load(key)
        for i in range(40):
            m.store(f"scan{i}", _value(100 + i))
        held = [",".join(m._tiers.holders(m.storage_key(key))) for key in hot]
        before = m.metrics.hits_of("cpu", "tensor")
        for i, key in enumerate(hot):
            assert torch.equal(m.load(key), _value(i))
        return held, (m.metrics.hits_of("cpu", "tensor") - before) / len(hot)


def test_arc_keeps_entries_read_again_through_a_scan_that_lru_lets_push_them_out(tmp_path: Path) -> None:
    held, hit_rate = _hot_after_scan(tmp_path, "arc")
    assert hit_rate == 1.0 and all(h.startswith("cpu") for h in held), held
    held, hit_rate = _hot_after_scan(tmp_path, "lru")
    assert hit_rate == 0.0 and all(h == "disk" for h in held), held  # the control: LRU demoted every one


def test_an_entry_read_again_after_leaving_comes_back_as_one_read_again(tmp_path: Path) -> None:
    """A demoted entry promoted back on a read is ARC's ghost hit: it returns among the entries read again,
    and the target share of entries read once grows (they were evicted too early)."""
    with kvmem.Memory(tmp_path / "kvmem", eviction="arc", **SETTINGS) as m:
        cpu = m._tiers.tiers[0]
        order = cpu._order
        assert isinstance(order, Arc)
        for i in range(20):  # more than fit: the oldest of those read once go down to disk
            m.store(f"k{i}", _value(i))
            if 4 <= i < 8:
                m.load(f"k{i}")  # read again: kept
        down = [i for i in range(20) if m._tiers.holders(m.storage_key(f"k{i}")) == ["disk"]]
        assert down and not set(down) & set(range(4, 8)), down
        last = down[-1]  # the newest to leave: its key is still remembered
        key = m.storage_key(f"k{last}")
        assert key in order._gone_once and order.target == 0
        assert torch.equal(m.load(f"k{last}"), _value(last))  # promoted back into the CPU tier
        assert m._tiers.holders(key)[0] == "cpu"
        assert key in order._again and key not in order._gone_once
        assert 0 < order.target <= order.size


def test_arc_accounts_every_byte_on_replace_delete_and_eviction() -> None:
    tier = CpuTier(64 * KIB, eviction="arc")
    order = tier._order
    assert isinstance(order, Arc)
    blob = _blob(1024)  # 4 KiB payload
    for i in range(8):
        tier.put(f"k{i}", blob)
    tier.get("k0")
    tier.put("k0", blob)  # a replace keeps it among entries read again
    tier.put("k1", blob)  # ... and k1 among entries read once
    assert "k0" in order._again and "k1" in order._once
    assert tier.delete("k2") and "k2" in order._gone_once
    held = {k: v for d in (order._once, order._again) for k, v in d.items()}
    assert sorted(held) == sorted(tier._entries)
    assert order._bytes[0] + order._bytes[1] == sum(held.values()) == 7 * blob.nbytes
    assert order._bytes[2] == sum(order._gone_once.values()) and order._bytes[3] == sum(order._gone_again.values())


def test_victims_offer_each_key_once_and_end_when_every_key_was_offered() -> None:
    """The tiered store may fail to move a victim (no room below); the order then offers the next one."""
    tier = CpuTier(64 * KIB, eviction="arc")
    blob = _blob(256)
    for i in range(5):
        tier.put(f"k{i}", blob)
    tier.get("k4")  # read again: offered after the entries read once (T1 is over its target of 0)
    assert list(tier.keys()) == ["k0", "k1", "k2", "k3", "k4"]
    lru = CpuTier(64 * KIB)
    for i in range(3):
        lru.put(f"k{i}", blob)
    lru.get("k0")
    assert list(lru.keys()) == ["k1", "k2", "k0"]


def test_ghosts_are_bounded_by_the_bytes_the_tier_held() -> None:
    """ARC's cache size is what the tier held at most (a tier that offloads at a threshold never holds its
    whole capacity); the keys it remembers are bounded by it."""
    order = Arc()
    for i in range(10):
        order.added(f"live{i}", KIB)
    for i in range(10):
        order.removed(f"live{i}")
    for i in range(100):
        order.added(f"k{i}", KIB)
        order.removed(f"k{i}")
    assert order.size == 10 * KIB
    assert order._bytes[0] + order._bytes[2] <= order.size and len(order._gone_once) == 10


def test_listing_an_arc_tier_gives_every_key_once() -> None:
    """Past the first keys (a room-making reader takes one or two) the rest comes as one snapshot: listing a
    large tier (entry counts, maintenance) is one pass, not a choice per key."""
    order = Arc()
    keys = [f"k{i}" for i in range(5000)]
    for key in keys:
        order.added(key, 1)
    for key in keys[::3]:
        order.hit(key)  # read again: listed after the entries read once
    listed = list(order.victims(threading.Lock()))
    assert sorted(listed) == sorted(keys)
    again = set(keys[::3])
    assert [k for k in listed if k not in again] == [k for k in keys if k not in again]
    assert listed[-len(again) :] == keys[::3]


def test_gpu_tier_takes_the_same_orders() -> None:
    tier = GpuTier(64 * KIB, device="cpu", eviction="arc")
    blob = _blob(256)
    for i in range(3):
        tier.put(f"k{i}", blob)
    tier.get("k0")
    assert list(tier.keys()) == ["k1", "k2", "k0"]
    assert tier.delete("k1") and list(tier.keys()) == ["k2", "k0"]


@pytest.mark.parametrize("bad", ["lfu", "LRU", "", 1])
def test_an_unknown_eviction_is_refused_with_what_is_accepted(tmp_path: Path, bad: object) -> None:
    with pytest.raises(ConfigError, match=r"eviction=.*accepted lru \| arc"):
        kvmem.Memory(tmp_path / "kvmem", eviction=bad)


def test_a_tier_built_directly_refuses_an_unknown_eviction() -> None:
    for build in (lambda: CpuTier(64 * KIB, eviction="lfu"), lambda: GpuTier(64 * KIB, device="cpu", eviction="lfu")):
        with pytest.raises(ConfigError, match=r"eviction='lfu': accepted lru \| arc"):
            build()
