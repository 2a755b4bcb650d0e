"""The prefill worker applies its hand-off policy per request: after the prefill (the default on a
fast same-host link, and before anything is measured) or layer by layer; the KV lands either way."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from kvcake.engine.config import EngineConfig
from kvcake.server.worker.config import Role, WorkerConfig
from kvcake.server.worker.handoff import HandoffPolicy
from kvcake.server.worker.link import MessageLink
from kvcake.server.worker.messages import (
    Abort,
    KvReserved,
    PrefillDone,
    PrefillOrder,
    RequestFailed,
    ReserveKv,
)
from kvcake.server.worker.prefill import PrefillRole
from kvcake.server.worker.worker import Worker
from tests.server.worker.links import next_of

ENGINE = EngineConfig(kv_cache_bytes=4 * 2**20)
SAMPLING = {"max_tokens": 2, "temperature": 0.0, "ignore_eos": True}


def test_each_request_is_handed_off_as_the_policy_says(monkeypatch: pytest.MonkeyPatch) -> None:
    submits: list[tuple[str, bool]] = []  # (request, submitted while the prefill still ran)
    original = PrefillRole._submit_layer

    def spy(self: PrefillRole, state: Any, *args: Any) -> None:
        submits.append((state.order.request_id, not state.first_token_sent))
        original(self, state, *args)

    monkeypatch.setattr(PrefillRole, "_submit_layer", spy)
    rng = np.random.default_rng(3)
    with Worker(WorkerConfig(role=Role.DECODE, engine=ENGINE, worker_id="d0")) as decode, \
            Worker(WorkerConfig(role=Role.PREFILL, engine=ENGINE, worker_id="p0")) as prefill:
        assert decode.engine is not None
        d_link, p_link = MessageLink.connect(decode.address), MessageLink.connect(prefill.address)
        try:
            def one(rid: str) -> None:
                prompt = rng.integers(0, 256, 40).tolist()
                d_link.send(ReserveKv(rid, prompt, SAMPLING))
                reserved = next_of(d_link, KvReserved)
                pool = decode.engine.pool.kv  # type: ignore[union-attr]
                pool[:, reserved.block_ids] = float("nan")
                p_link.send(PrefillOrder(rid, prompt, SAMPLING, [], reserved.kv_pool,
                                         reserved.block_ids, reserved.num_pool_blocks))
                done = next_of(p_link, PrefillDone, RequestFailed)
                assert isinstance(done, PrefillDone), done
                assert bool(torch.isfinite(pool[:, reserved.block_ids]).all())
                d_link.send(Abort(rid))

            one("first")  # nothing measured yet: after the prefill
            role = prefill._role  # noqa: SLF001 - the policy is the worker's own
            assert isinstance(role, PrefillRole)
            role._handoff = HandoffPolicy(min_transfer_s=0.0, probe_every=1000,
                                          bandwidth_bytes_per_s=1.0)  # a very slow link
            one("slow")
        finally:
            d_link.close()
            p_link.close()
    first = {during for rid, during in submits if rid == "first"}
    slow = {during for rid, during in submits if rid == "slow"}
    assert first == {False}  # every write after the first token
    assert slow == {True}  # every write from the layer hook
