"""Configuration of one transfer engine: a frozen dataclass, validated on construction."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvcake.auth import ClusterSecret
from kvcake.transfer import checksum

MIB = 1 << 20


@dataclass(frozen=True)
class TransferConfig:
    """How one engine serves its segments and moves slices.

    slice_bytes: requests are cut into slices of this size, the unit that goes to one rail and is
      retried alone. The paper uses 16 KiB for RDMA, where a work request costs the CPU nothing. Over
      TCP from Python each slice costs a round trip, a header and a few interpreter steps, so the
      default is 4 MiB: on loopback here the CPU per GB moved (client + server) was ~1.1 s at
      256 KiB slices, ~0.7 s at 1 MiB and ~0.6 s at 4 MiB (iperf3: ~0.5 s), and a 16 MiB object
      still spreads over 4 rails.
    num_rails: connections used in parallel to reach one peer (one per NIC where there are NICs; on
      loopback, N TCP connections), each driven by its own thread (socket calls release the GIL).
    rail_bind_hosts: optional local address per rail, to pin a rail's connections to one NIC.
    max_endpoints_per_rail: bound of each rail's endpoint pool (SIEVE eviction beyond it).
    pipeline_depth: slices one rail keeps in flight on one TCP connection (requests sent before
      the earlier replies are in; replies matched by id). 1 = one round trip per slice: the link
      then idles while the client checks a slice and sends the next request. 2 hides that
      round trip; deeper only adds slices in flight that compete for cache and CPU (depth 4 was no
      faster here, on 2 loaded cores; see docs/benchmarks.md).
    inline_max_slices: the synchronous calls (`transfer`, `read`, `write`) move a batch of at most
      this many slices on the caller's thread, with its own endpoints, instead of handing it to
      the rail threads: two thread hand-offs cost more than a small transfer on a busy host
      (0 = always use the rails). Retries still go to the rails.
    max_retries: how many times one slice may be retried on another rail before its request fails.
    checksum: the per-slice digest: "auto" (xxh3 when the xxhash package is installed, else
      crc32), "crc32" or "xxh3".
    checksum_tcp / checksum_shm: carry and verify a digest per slice on that transport. Off by
      default on both, as in Mooncake's transfer engine, NCCL and NIXL: TCP checks every segment
      (a NIC offloads it) and Ethernet every frame, and a digest here costs a full extra pass over
      cold memory at each end: xxh3 at ~8 GB/s out of DRAM, ~0.25-0.3 CPU s/GB for the two ends
      together on loopback here, against ~0.55 for the whole transfer without it (and 0.48 for
      iperf3; see docs/benchmarks.md). Turn it on where nothing checks the bytes end to end and a
      bad NIC or kernel copy must not go unnoticed: the serving workers do, for the KV they stream
      into a decode engine's blocks. The store needs neither: every object carries its own
      checksum, a node verifies the bytes of a put that crosses TCP against it as they land, and
      every read is verified before it is trusted.
    use_shared_memory: map a peer's shared-memory segment when it lives on this host.
    host, port, port_search: where the segment server listens (`serve=True`); it tries `port`,
      `port + 1`, ... `port + port_search - 1` and keeps the first free one (0 = any port).
      `host` is also the address written into segment descriptors, unless `advertise_host`
      names the one peers dial (binding 0.0.0.0, or behind an address peers see differently).
    io_timeout_s: a socket call that blocks longer than this fails the slice (then it is retried).
    socket_buffer_bytes: SO_SNDBUF / SO_RCVBUF asked of the kernel for every data connection;
      0 (the default) leaves them to the kernel's autotuning, which sizes them to the path (as
      iperf3 does). On loopback here a fixed 256 KiB moved 5-20% more GB/s than autotuning or
      8 MiB (fewer bytes waiting in socket buffers: warmer kernel copies;
      benchmarks/transfer_socket_buffers.py), but it would cap a long-RTT path at 256 KiB in
      flight per connection, so the default stays with the kernel.
    secret: the cluster secret (`kvcake.auth`). With one, the segment server admits only peers
      that prove it, and this engine proves it to every server it connects to (both must hold
      the same). None (the default): open ports, as before; shared memory is unaffected.
    """

    slice_bytes: int = 4 * MIB
    num_rails: int = 4
    rail_bind_hosts: tuple[str, ...] = ()
    max_endpoints_per_rail: int = 64
    pipeline_depth: int = 2
    inline_max_slices: int = 2
    max_retries: int = 3
    checksum: str = "auto"
    checksum_tcp: bool = False
    checksum_shm: bool = False
    use_shared_memory: bool = True
    serve: bool = True
    host: str = "127.0.0.1"
    advertise_host: str | None = None
    port: int = 0
    port_search: int = 1
    io_timeout_s: float = 30.0
    socket_buffer_bytes: int = 0
    secret: ClusterSecret | None = None

    def __post_init__(self) -> None:
        positive = ("slice_bytes", "num_rails", "max_endpoints_per_rail", "pipeline_depth",
                    "port_search")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"TransferConfig.{name} must be a positive integer, got {value!r}")
        if (not isinstance(self.socket_buffer_bytes, int) or isinstance(self.socket_buffer_bytes, bool)
                or self.socket_buffer_bytes < 0):
            raise ValueError(f"TransferConfig.socket_buffer_bytes must be an integer >= 0 (0 = the "
                             f"kernel's autotuning), got {self.socket_buffer_bytes!r}")
        if self.slice_bytes < 4096:
            raise ValueError(f"TransferConfig.slice_bytes must be >= 4096, got {self.slice_bytes}")
        if not isinstance(self.inline_max_slices, int) or self.inline_max_slices < 0:
            raise ValueError(f"TransferConfig.inline_max_slices must be >= 0, got "
                             f"{self.inline_max_slices!r}")
        if not isinstance(self.max_retries, int) or self.max_retries < 0:
            raise ValueError(f"TransferConfig.max_retries must be >= 0, got {self.max_retries!r}")
        if self.rail_bind_hosts and len(self.rail_bind_hosts) != self.num_rails:
            raise ValueError(
                f"TransferConfig.rail_bind_hosts has {len(self.rail_bind_hosts)} entries; give one "
                f"per rail (num_rails={self.num_rails}) or none")
        if not 0 <= self.port <= 65535 or self.port + self.port_search - 1 > 65535:
            raise ValueError(f"TransferConfig.port must be in 0..65535, got {self.port}")
        checksum.parse(self.checksum, "TransferConfig.checksum")
        if not self.io_timeout_s > 0:
            raise ValueError(f"TransferConfig.io_timeout_s must be > 0, got {self.io_timeout_s}")
        if self.secret is not None and not isinstance(self.secret, ClusterSecret):
            raise ValueError("TransferConfig.secret must be a ClusterSecret or None, got "
                             f"{type(self.secret).__name__}: load one with "
                             "kvcake.auth.ClusterSecret.load(file=..., env=...)")

    def digests(self, over_tcp: bool, checksum_tcp: bool | None = None) -> bool:
        """Whether a slice carries a digest: over TCP the request's `checksum_tcp` if it set
        one, else `checksum_tcp`; over shared memory `checksum_shm`."""
        if not over_tcp:
            return self.checksum_shm
        return self.checksum_tcp if checksum_tcp is None else checksum_tcp

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TransferConfig:
        """Build from plain data (a TOML table); unknown keys are an error."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown transfer config keys {unknown}; known keys: {sorted(known)}")
        fixed = dict(values)
        if "rail_bind_hosts" in fixed:
            fixed["rail_bind_hosts"] = tuple(fixed["rail_bind_hosts"])
        return cls(**fixed)
