"""The embedded store (real master, two nodes, transfer engine, manual clock) against a reference
model: a dict of the bytes put, the exact LRU order of accesses, leases and pins.

The model does not re-implement placement; it checks what must hold whatever the placement:
- a get returns exactly the bytes put, or KeyError for a key removed or evicted;
- only unleased objects are ever evicted, and eviction is LRU: an object never goes while an
  older, unleased, unpinned one that was a candidate for the same eviction (a replica on every
  node the evicted one had) stays, and a pinned one never goes while an unpinned candidate stays;
- an object has at most one replica per node, and change_replica reports what the master holds;
- the pool never holds more than its capacity.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcake.clock import ManualClock
from kvcake.store.config import EmbeddedConfig, MasterConfig
from kvcake.store.embedded import EmbeddedStore
from kvcake.store.errors import NoSpace, ObjectNotFound

KEYS = st.sampled_from([f"k{i}" for i in range(10)])
SIZES = st.sampled_from([0, 1000, 3000, 6000])
LEASE_S = 5.0


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = ManualClock(0.0)
        config = MasterConfig(high_watermark=0.8, low_watermark=0.6, lease_s=LEASE_S,
                              heartbeat_timeout_s=1e9, put_timeout_s=1e9)
        self.store = EmbeddedStore(EmbeddedConfig(16 << 10, num_nodes=2, master=config),
                                   clock=self.clock)
        self.store.start()
        self.client = self.store.client()
        self.data: dict[str, bytes] = {}
        self.order: list[str] = []  # least recently used first
        self.lease_until: dict[str, float] = {}
        self.pinned: set[str] = set()
        self.nodes_of: dict[str, set[str]] = {}
        self.just_put: str | None = None

    def teardown(self) -> None:
        self.store.close()

    def _touch(self, key: str) -> None:
        if key in self.order:
            self.order.remove(key)
        self.order.append(key)

    # ---- rules ---------------------------------------------------------------------------------
    @rule(key=KEYS, size=SIZES, fill=st.integers(0, 255), replicas=st.integers(1, 3))
    def put(self, key: str, size: int, fill: int, replicas: int) -> None:
        value = bytes((fill + i) % 256 for i in range(size))
        self.client.num_replicas = replicas
        try:
            written = self.client.put(key, value)
        except NoSpace:
            assert key not in self.data
            return
        assert written == (key not in self.data)
        if written:  # a new object: no lease or pin of an earlier object of this key applies
            self.data[key] = value
            self.lease_until.pop(key, None)
            self.pinned.discard(key)
            self._touch(key)
            self.just_put = key

    @rule(key=KEYS)
    def get(self, key: str) -> None:
        if key not in self.data:
            try:
                self.client.get(key)
            except ObjectNotFound:
                return
            raise AssertionError(f"{key} was never put or was removed, yet it was served")
        assert self.client.get(key) == self.data[key]
        self._touch(key)  # the read's lease is released when it completes: none to model

    @rule(keys=st.lists(KEYS, min_size=1, max_size=4, unique=True))
    def get_batch(self, keys: list[str]) -> None:
        buffers = [bytearray(8000) for _ in keys]
        sizes = self.client.get_batch_into(keys, buffers)
        for key, size, buffer in zip(keys, sizes, buffers, strict=True):
            if key in self.data:
                assert size == len(self.data[key]) and bytes(buffer[:size]) == self.data[key]
                self._touch(key)  # leases released with the batch
            else:
                assert size is None

    @rule(key=KEYS)
    def remove(self, key: str) -> None:
        if key in self.data:
            self.client.remove(key)
            del self.data[key]
            self.order.remove(key)
            self.pinned.discard(key)
            self.lease_until.pop(key, None)
        else:
            try:
                self.client.remove(key)
            except KeyError:
                return
            raise AssertionError(f"removing absent {key} succeeded")

    @precondition(lambda self: bool(self.data))
    @rule(pick=st.integers(0, 100))
    def pin(self, pick: int) -> None:
        key = sorted(self.data)[pick % len(self.data)]
        self.client.pin(key)
        self.pinned.add(key)

    @precondition(lambda self: bool(self.data))
    @rule(pick=st.integers(0, 100), num=st.integers(1, 3))
    def change_replica(self, pick: int, num: int) -> None:
        key = sorted(self.data)[pick % len(self.data)]
        try:
            have = self.client.change_replica(key, num)
        except NoSpace:
            return
        finally:  # the copy reads the object: an access; its lease is released when done
            self._touch(key)
        assert have == len(self.store.master.index.objects[key].dram())
        assert have == min(num, 2) or (num > 1 and have >= 1)

    @rule(delta_s=st.sampled_from([1.0, 3.0, 6.0]))
    def advance(self, delta_s: float) -> None:
        self.clock.advance(delta_s)
        self.store.master.tick()

    # ---- what must hold after every step ------------------------------------------------------
    @invariant()
    def evictions_respect_leases_and_lru(self) -> None:
        now_s = self.clock.now_s()
        index = self.store.master.index
        vanished = [k for k in self.data if not self.client.exists(k)]
        survivors = [k for k in self.order if k not in vanished]
        for gone in vanished:
            assert self.lease_until.get(gone, 0.0) <= now_s, f"leased {gone} was evicted"
            older = self.order[: self.order.index(gone)]
            for other in older:
                if (other in survivors and other != self.just_put and other not in self.pinned
                        and self.lease_until.get(other, 0.0) <= now_s
                        and self.nodes_of.get(other, set()) >= self.nodes_of.get(gone, {"?"})):
                    raise AssertionError(f"{gone} was evicted before the older {other}")
            if gone in self.pinned:  # a soft pin goes only when no unpinned candidate is left
                for other in survivors:
                    if (other != self.just_put and other not in self.pinned
                            and self.lease_until.get(other, 0.0) <= now_s
                            and self.nodes_of.get(other, set()) >= self.nodes_of[gone]):
                        raise AssertionError(f"pinned {gone} was evicted before {other}")
        for gone in vanished:
            del self.data[gone]
            self.lease_until.pop(gone, None)
            self.order.remove(gone)
            self.pinned.discard(gone)
        self.just_put = None
        for key in self.data:
            nodes = [r.node_id for r in index.objects[key].dram()]
            assert len(nodes) == len(set(nodes)), f"{key} has two replicas on one node"
            self.nodes_of[key] = set(nodes)
        for node in index.nodes.values():
            assert node.allocator.used_bytes <= node.allocator.capacity_bytes


StoreMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)
TestStoreMachine = StoreMachine.TestCase
