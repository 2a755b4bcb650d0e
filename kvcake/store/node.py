"""A store node: contributes a DRAM segment (served by its transfer engine) and an optional SSD
tier to the pool, registers with the master and keeps heartbeating.

Clients read and write the segment directly through the transfer engine; the master only asks the
node to move objects between its DRAM and its disk (demote / promote / drop_disk) and to revoke
the replicas it dropped (`revoke`: their headers marked, so no remembered location serves them).

    node = StoreNode(NodeConfig(dram_bytes=4 << 30), "127.0.0.1:21000")
    node.start() ... node.close()    # close() unregisters: the master drops this node's replicas
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from typing import Any

from kvcake.auth import ClusterSecret
from kvcake.store.config import NodeConfig, override
from kvcake.store.disk import DiskTier
from kvcake.store.errors import InvalidRequest, StoreError
from kvcake.store.forward import ForwardServer
from kvcake.store.layout import HEADER_BYTES, CorruptObject, pack_header, verify
from kvcake.store.layout import revoke as revoke_header
from kvcake.store.master import MasterService
from kvcake.store.prefault import fault_in
from kvcake.store.rebuild import parse_entry
from kvcake.store.remote import RemoteMaster
from kvcake.store.rpc_server import RpcServer
from kvcake.transfer import TransferConfig, TransferEngine

log = logging.getLogger(__name__)


class StoreNode:
    """`master` is "HOST:PORT" (a remote master: the node serves a control port for it) or an
    in-process `MasterService` (embedded: no sockets for control, no heartbeat thread).

    `secret` (default: `transfer_config.secret`): the cluster secret the node proves to the
    master and asks of everyone on its control port and, with its own engine, its segment
    server. None: open ports."""

    def __init__(self, config: NodeConfig, master: str | MasterService, *,
                 node_id: str | None = None, engine: TransferEngine | None = None,
                 transfer_config: TransferConfig | None = None,
                 secret: ClusterSecret | None = None, **options: Any) -> None:
        """`options`: `NodeConfig` fields replacing `config`'s (e.g. `host=`,
        `advertise_host=`); an unknown one is a ValueError."""
        config = override(config, options)
        host = config.host
        self.config = config
        self.node_id = node_id or f"node-{uuid.uuid4().hex[:8]}"
        self._master_arg = master
        self._master: RemoteMaster | MasterService | None = None
        self._own_engine = engine is None
        transfer = transfer_config or TransferConfig(host=host)
        self._secret = secret if secret is not None else transfer.secret
        if transfer.secret is None and self._secret is not None:
            transfer = dataclasses.replace(transfer, secret=self._secret)
        self.engine = engine or TransferEngine(transfer)
        self._host = host
        self._advertise_host = config.advertise_host  # what the master dials
        self._segment_name = f"store-{self.node_id}"
        self._disk = DiskTier(config.disk_dir) if config.disk_dir and config.disk_bytes else None
        self._control: RpcServer | None = None
        self._forward: ForwardServer | None = None  # forward.py: slot puts committed from here
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        # key -> [key, offset, alloc_bytes, version, size_bytes, checksum]: the committed objects
        # in this segment, as the master mirrors them (failover on; rebuild.py)
        self._held: dict[str, list[int | str]] = {}
        self._held_lock = threading.Lock()

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self) -> StoreNode:
        """Mount the segment and register; on any failure (an unreachable master) what was
        started is stopped again: the control server no longer serves, the segment is gone."""
        try:
            return self._start()
        except BaseException:
            self.close(unregister=False)
            raise

    def _start(self) -> StoreNode:
        if self._own_engine:
            self.engine.start()
        desc = self.engine.allocate_segment(self._segment_name, self.config.dram_bytes)
        if self.config.prefault:  # before registering: no object lands on a page not yet there
            started_s = time.monotonic()
            how = fault_in(self.engine.segment(self._segment_name).view)
            log.info("node %s: %d DRAM bytes made resident in %.2f s (%s)", self.node_id,
                     self.config.dram_bytes, time.monotonic() - started_s, how)
        if self._disk is not None:
            self._disk.open()
        endpoint: dict[str, Any] = {"segment": desc.to_dict()}
        if isinstance(self._master_arg, str):
            self._control = RpcServer(self._handle_control, self._host, 0,
                                      secret=self._secret).start()
            if not self._master_arg.startswith("etcd://"):  # (clients use no slots there)
                self._forward = ForwardServer(self._view, self._master_arg, host=self._host,
                                              secret=self._secret).start()
                endpoint["forward"] = self._advertised(self._forward.address)
            remote = self._master = RemoteMaster(self._master_arg, secret=self._secret)
            remote.register_node(self.node_id, self.config.dram_bytes,
                                       self.config.disk_bytes, endpoint,
                                       control_address=self._control_address())
            self._heartbeat = threading.Thread(target=self._beat, args=(endpoint,),
                                               name=f"heartbeat-{self.node_id}", daemon=True)
            self._heartbeat.start()
        else:
            local = self._master = self._master_arg
            local.register_node(self.node_id, self.config.dram_bytes,
                                       self.config.disk_bytes, endpoint, handle=self)
        log.info("node %s serving %d DRAM bytes%s", self.node_id, self.config.dram_bytes,
                 f" and {self.config.disk_bytes} disk bytes" if self._disk else "")
        return self

    def close(self, unregister: bool = True) -> None:
        """Leave the pool. `unregister=False` simulates a crash (the master notices by itself).

        A crash takes the node's memory with it: its segment stops being served before any of its
        ports is seen to close, so a client that remembered a replica here cannot read it once the
        master has been told the node is gone (a graceful leave unregisters first instead, and the
        master revokes what it drops)."""
        self._stop.set()
        if not unregister:
            self._stop_serving_data()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5)
        if self._master is not None and unregister:
            try:
                self._master.unregister_node(self.node_id)
            except (StoreError, OSError) as exc:
                log.warning("could not unregister from the master: %s", exc)
        if isinstance(self._master, RemoteMaster):
            self._master.close()
        self._master = None
        if self._control is not None:
            self._control.close()
        if self._forward is not None:
            self._forward.close()
        self._stop_serving_data()

    def _stop_serving_data(self) -> None:
        """Withdraw the node's segment from its transfer engine (and close an engine it owns)."""
        try:
            self.engine.unregister_segment(self._segment_name)
        except KeyError:
            pass
        if self._own_engine:
            self.engine.close()

    def __enter__(self) -> StoreNode:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "dram_bytes": self.config.dram_bytes,
                "disk_used_bytes": self._disk.used_bytes() if self._disk else 0}

    # ---- what the master asks ----------------------------------------------------------------------
    def demote(self, key: str, offset: int, alloc_bytes: int, version: int,
               disk_version: int) -> None:
        self._require_disk().demote(self._view(), offset, alloc_bytes, version, disk_version)

    def promote(self, key: str, offset: int, alloc_bytes: int, version: int,
                disk_version: int) -> None:
        self._require_disk().promote(self._view(), offset, alloc_bytes, version, disk_version)

    def drop_disk(self, key: str, disk_version: int) -> None:
        self._require_disk().drop(disk_version)

    def revoke(self, entries: list[list[int]]) -> int:
        """Mark the replicas [[offset, version], ...] revoked where their header still holds
        that version (layout.revoke); returns how many were."""
        view = self._view()
        done = 0
        for entry in entries:
            if not (isinstance(entry, list | tuple) and len(entry) == 2
                    and all(isinstance(v, int) and not isinstance(v, bool) for v in entry)):
                raise InvalidRequest("entries: each must be [offset, version]")
            done += int(revoke_header(view, entry[0], entry[1]))
        return done

    def payload_window(self, offset: int, size_bytes: int) -> memoryview:
        """The payload range of the replica at `offset` (its header before it) in this node's
        segment: where a hosting master's in-process put writes the bytes (hosted.py)."""
        view = self._view()
        start = offset + HEADER_BYTES
        if offset < 0 or size_bytes < 0 or start + size_bytes > len(view):
            raise InvalidRequest(f"offset: [{offset}, {start + size_bytes}) is not inside the "
                                 f"segment of {len(view)} bytes")
        return view[start:start + size_bytes]

    def write_header(self, offset: int, version: int, checksum: int, size_bytes: int) -> None:
        """The header of the replica at `offset`, written once its payload is in place."""
        self._view()[offset:offset + HEADER_BYTES] = pack_header(checksum, version, size_bytes)

    # ---- internals ---------------------------------------------------------------------------------
    def _view(self) -> memoryview:
        return self.engine.segment(self._segment_name).view

    def _require_disk(self) -> DiskTier:
        if self._disk is None:
            raise InvalidRequest(f"node {self.node_id} has no disk tier")
        return self._disk

    def _handle_control(self, op: str, args: dict[str, Any], session: dict[str, Any]) -> Any:
        if op == "hold":
            entries = [parse_entry(item) for item in args["objects"]]
            with self._held_lock:
                self._held.update({e[0]: list(e) for e in entries})
            return None
        if op == "forget":
            with self._held_lock:
                for item in args["objects"]:
                    if isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) \
                            and self._held.get(item[0], [None] * 4)[3] == item[1]:
                        del self._held[item[0]]
            return None
        if op not in ("demote", "promote", "drop_disk", "revoke"):
            raise InvalidRequest(f"op: a node serves only demote/promote/drop_disk/revoke/hold/"
                                 f"forget, not {op!r}")
        return getattr(self, op)(**args)

    def held_objects(self) -> list[list[int | str]]:
        """The catalogue entries whose bytes are still in the segment, intact (header version
        and payload checksum checked): what a new master may adopt. Stale ones are dropped."""
        view = self._view()
        with self._held_lock:
            entries = list(self._held.values())
        intact = []
        for entry in entries:
            key, offset, _, version, size, checksum = entry
            assert isinstance(offset, int) and isinstance(size, int)
            start = offset + HEADER_BYTES
            try:
                verify(view[offset:start], view[start:start + size], int(version), int(checksum))
            except CorruptObject:
                with self._held_lock:
                    self._held.pop(str(key), None)
                continue
            intact.append(entry)
        return intact

    def _control_address(self) -> str:
        assert self._control is not None
        return self._advertised(self._control.address)

    def _advertised(self, address: str) -> str:
        """`address` (one of this node's ports) as peers dial it."""
        if self._advertise_host is None:
            return address
        return f"{self._advertise_host}:{address.rpartition(':')[2]}"

    def _beat(self, endpoint: dict[str, Any]) -> None:
        while not self._stop.wait(self.config.heartbeat_interval_s):
            master = self._master
            if master is None:
                return
            try:
                if not master.heartbeat(self.node_id, self.stats()):
                    # Declared dead (e.g. a long pause): whatever it held is forgotten.
                    # Declared dead (e.g. a long pause) or a new master (failover): register
                    # again with the committed objects this segment still holds.
                    held = self.held_objects()
                    log.warning("node %s is unknown to the master: registering again with %d "
                                "objects", self.node_id, len(held))
                    assert isinstance(master, RemoteMaster)
                    master.register_node(self.node_id, self.config.dram_bytes,
                                         self.config.disk_bytes, endpoint,
                                         control_address=self._control_address(),
                                         objects=held)
            except (StoreError, OSError) as exc:
                log.warning("heartbeat failed: %s", exc)
