"""kvcake transfer engine: move bytes between local buffers and registered segments anywhere.

    engine = TransferEngine(TransferConfig(port=20000, port_search=100))
    engine.start()
    desc = engine.allocate_segment("dram", 1 << 30)          # served to peers; desc is plain data
    ...                                                       # on a peer, with desc.to_dict() sent over:
    peer.write(SegmentDesc.from_dict(d), 4096, data)          # synchronous helpers
    batch = peer.submit([TransferRequest(TransferOp.READ, buf, desc, 4096), ...])
    peer.status(batch); peer.wait(batch, timeout_s=5).raise_for_failure()
    engine.close()

Requests are cut into `config.slice_bytes` slices striped over `config.num_rails` rails (per-segment
preference via `set_rail_preference`); same-host shared-memory segments are mapped and copied,
others go over TCP to the owner's segment server, `config.pipeline_depth` slices in flight per
connection. See kvcake/transfer/engine.py for the contract.
"""

from kvcake.transfer.config import TransferConfig
from kvcake.transfer.engine import TransferEngine
from kvcake.transfer.errors import TransferError, TransferTimeout, TransportError
from kvcake.transfer.faulty import FaultSpec, FaultyTransport
from kvcake.transfer.plan import RailPreference, Slice, plan_slices, retry_rail
from kvcake.transfer.request import (
    BatchId,
    BatchStatus,
    RequestState,
    RequestStatus,
    TransferOp,
    TransferRequest,
)
from kvcake.transfer.segment import (
    Segment,
    SegmentDesc,
    buffer_view,
    local_host_id,
)
from kvcake.transfer.sieve import SieveCache
from kvcake.transfer.transport import (
    Completion,
    EndpointKey,
    PipelinedTransport,
    Transport,
    TransportKind,
    TransportWrapper,
)

__all__ = [
    "BatchId", "BatchStatus", "Completion", "EndpointKey", "FaultSpec", "FaultyTransport", "PipelinedTransport",
    "RailPreference",
    "RequestState", "RequestStatus", "Segment", "SegmentDesc", "SieveCache", "Slice",
    "TransferConfig", "TransferEngine", "TransferError", "TransferOp", "TransferRequest",
    "TransferTimeout", "Transport", "TransportError", "TransportKind", "TransportWrapper",
    "buffer_view", "local_host_id", "plan_slices", "retry_rail",
]
