"""The instances the Conductor places on: each prefill instance's queue, each decode instance's
load, and the chunked-pipeline (CPP) groups the prefill instances form.

`queues` and `decodes` are the live books, in registration order (the order that breaks ties);
the dicts themselves never change identity, so a caller may keep a reference. `prefill_pool` (the
prefill instances placed alone) and `cpp_groups` are rebuilt on every change.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from kvcake.conductor.cpp import cpp_groups
from kvcake.conductor.load import DecodeLoad, PrefillQueue


class InstancePools:
    """Prefill and decode instances by id. `cpp_min_tokens` None: CPP off, no groups."""

    def __init__(self, cpp_nodes: int, cpp_min_tokens: int | None) -> None:
        self._cpp_nodes = cpp_nodes
        self._cpp_min_tokens = cpp_min_tokens
        self.queues: dict[str, PrefillQueue] = {}
        self.decodes: dict[str, DecodeLoad] = {}
        self.prefill_pool: tuple[str, ...] = ()  # the keys of queues placed alone
        self.cpp_groups: tuple[tuple[str, ...], ...] = ()  # CPP: the pool cut into groups
        # CPP members (layer slices, never placed alone) -> position in their group's pipeline
        self.cpp_members: dict[str, int] = {}

    def add_prefill(self, instance_id: str, cpp_member: int | None = None) -> None:
        """`cpp_member`: the instance is that stage (0-based) of a dedicated CPP group: it holds
        only a slice of the layers, so it prefills only as part of its group (the group forms
        once stages 0..cpp_nodes-1 are all registered), never alone."""
        if instance_id in self.queues:
            raise ValueError(f"prefill instance {instance_id!r} is already registered")
        if cpp_member is not None:
            if not 0 <= cpp_member < self._cpp_nodes:
                raise ValueError(f"cpp_member: must be in [0, {self._cpp_nodes}), got "
                                 f"{cpp_member}")
            self.cpp_members[instance_id] = cpp_member
        self.queues[instance_id] = PrefillQueue()
        self._changed()

    def add_decode(self, instance_id: str) -> None:
        if instance_id in self.decodes:
            raise ValueError(f"decode instance {instance_id!r} is already registered")
        self.decodes[instance_id] = DecodeLoad()

    def remove(self, instance_id: str) -> None:
        """Forget an instance in either role (unknown ids are ignored)."""
        self.queues.pop(instance_id, None)
        self.cpp_members.pop(instance_id, None)
        self._changed()
        self.decodes.pop(instance_id, None)

    def queue(self, instance_id: str) -> PrefillQueue:
        try:
            return self.queues[instance_id]
        except KeyError:
            raise ValueError(f"unknown prefill instance {instance_id!r}; known: "
                             f"{', '.join(self.queues)}") from None

    def decode(self, instance_id: str) -> DecodeLoad:
        try:
            return self.decodes[instance_id]
        except KeyError:
            raise ValueError(f"unknown decode instance {instance_id!r}; known: "
                             f"{', '.join(self.decodes)}") from None

    def group_blocks(self, blocks: list[int]) -> list[int]:
        """Each CPP group's local prefix blocks, given each pool instance's (`blocks`, in pool
        order): the fewest any member holds (a dedicated member, outside the pool, holds no whole
        block: no local prefix)."""
        position = {instance_id: i for i, instance_id in enumerate(self.prefill_pool)}
        return [min(blocks[position[m]] if m in position else 0 for m in group)
                for group in self.cpp_groups]

    def group_queue_s(self, now_s: float) -> list[float]:
        """Each CPP group's queue: its busiest member's (the pipeline holds them all)."""
        queues = self.queues
        return [max(queues[m].queue_s(now_s) for m in group) for group in self.cpp_groups]

    def _changed(self) -> None:
        members = self.cpp_members
        self.prefill_pool = tuple(i for i in self.queues if i not in members) if members \
            else tuple(self.queues)
        if self._cpp_min_tokens is None:
            return
        if not members:
            self.cpp_groups = cpp_groups(self.prefill_pool, self._cpp_nodes)
            return
        stages = sorted(members, key=members.__getitem__)
        complete = [members[m] for m in stages] == list(range(self._cpp_nodes))
        self.cpp_groups = (tuple(stages),) if complete else ()
