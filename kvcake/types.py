"""Shared value types. Pure: imported by policy code, the engine and the services alike."""

from __future__ import annotations

from typing import NewType

BlockKey = NewType("BlockKey", int)
"""Chained prefix hash of one full block of tokens (see kvcake.hashing). 64-bit unsigned."""

BlockId = NewType("BlockId", int)
"""Index of a physical block in one engine instance's paged KV pool."""

RequestId = NewType("RequestId", str)
InstanceId = NewType("InstanceId", str)
"""Names a prefill, decode or colocated engine instance (a worker), e.g. "prefill-0"."""

NodeId = NewType("NodeId", str)
"""Names a store node (a process that contributes a memory segment to the pool)."""
