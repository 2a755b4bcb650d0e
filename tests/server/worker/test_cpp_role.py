"""`CppRole` on its own (a fake worker host): a stage that holds less of the prefix than the
group reuses (stage 0's first chunk starts after it) fails the request, saying so, and gives the
inbox slot back."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING

from kvcake.engine.config import EngineConfig
from kvcake.engine.stage import StageEngine, split_layers
from kvcake.server.worker.config import Role, WorkerConfig
from kvcake.server.worker.cpp_role import CppRole
from kvcake.server.worker.messages import (
    CppHidden,
    CppOrder,
    CppSlotFree,
    Message,
    RequestFailed,
    Sampling,
)
from kvcake.transfer import TransferConfig, TransferEngine

if TYPE_CHECKING:
    from kvcake.engine.engine import Engine
    from kvcake.store import StoreClient

CONFIG = EngineConfig(kv_cache_bytes=4 * 2**20, device="cpu")


class Host:
    def __init__(self, transfer: TransferEngine) -> None:
        self.config = WorkerConfig(role=Role.CPP, cpp_member=1, cpp_nodes=2, cpp_chunk_tokens=40)
        self.worker_id = "cpp-1"
        self.engine: Engine | None = None
        self.transfer: TransferEngine | None = transfer
        self.store: StoreClient | None = None
        self.sent: list[Message] = []

    def send(self, message: Message) -> None:
        self.sent.append(message)

    def send_many(self, messages: list[Message]) -> None:
        self.sent.extend(messages)

    def post(self, item: object) -> None:
        raise AssertionError("nothing to post without a store")


def test_a_stage_short_of_the_groups_prefix_fails_the_request_clearly() -> None:
    with TransferEngine(TransferConfig(port=0)) as transfer:
        host = Host(transfer)
        role = CppRole(host, StageEngine("tiny", split_layers(4, 2)[1], CONFIG))
        prompt = list(range(150))
        # Planned with a 6-block prefix, but this stage has no store: it reads none of it.
        role.handle(CppOrder("r", prompt, asdict(Sampling(max_tokens=4)), {}, {}, [], 0,
                             list(range(6))))
        role.handle(CppHidden("r", 96, 40, 1))  # stage 0 reused 96 tokens
        assert role.has_pending()
        role.step()
        assert host.sent[0] == CppSlotFree("r", 1)
        failed = host.sent[-1]
        assert isinstance(failed, RequestFailed) and failed.request_id == "r"
        assert "reuses a prefix of 96 tokens, this stage read only 0" in failed.message
        assert role.num_chunks == 0 and not role.has_pending() and role.num_pending() == 0
        assert role.stage.block_manager.num_free_blocks == role.stage.block_manager.num_blocks
