"""A worker: one engine instance, its transfer engine and store node, served to one frontend.

Lifecycle:
  Worker(config)  builds nothing that runs;
  start()         loads the engine (a decode worker's KV pool is a segment of its transfer
                  engine: shared memory unless `shared_memory` is off), starts the transfer
                  engine, mounts a DRAM segment into the store pool (a store node in this
                  process, when a master is configured), opens the control port and starts
                  two threads: the accept loop (one reader per frontend connection) and the
                  engine loop, the only thread that touches the engine;
  close()         stops both, closes the node (unregistering it) and the transfer engine.

The engine loop takes messages from an inbox (filled by the reader), lets the role act on
them (`prefill.PrefillRole`, `decode.DecodeRole`), steps the engine while work
is pending and publishes the prefix cache's KV events and the load after every step. With no
work it blocks on the inbox: an idle worker burns no CPU.

On connect the worker sends `Hello` (identity, KV layout). Messages to a
frontend that is gone are dropped: the frontend fails those requests itself. The engine loop
answers the frontend's `Ping` between steps (not the reader thread), so a worker whose loop
stalls stops answering and the frontend fails it after `MonitorConfig.worker_timeout_s`.
`hold()` / `release()` stall the engine loop on purpose (fault injection for tests).
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import uuid
from typing import TYPE_CHECKING, Any

from kvcake import auth
from kvcake.engine.engine import Engine
from kvcake.engine.stage import StageEngine
from kvcake.server.worker import components
from kvcake.server.worker.config import Role, WorkerConfig
from kvcake.server.worker.cpp_role import CppRole
from kvcake.server.worker.decode import DecodeRole
from kvcake.server.worker.kv_event_publisher import KvEventPublisher
from kvcake.server.worker.link import MessageLink
from kvcake.server.worker.messages import (
    Hello,
    KvEvents,
    LoadReport,
    Message,
    MessageError,
    Ping,
    Pong,
    Shutdown,
)
from kvcake.server.worker.metrics import WorkerCollector, WorkerCounts, serve_metrics
from kvcake.server.worker.prefill import PrefillRole
from kvcake.server.worker.role import WorkerRole
from kvcake.store import StoreClient, StoreNode
from kvcake.transfer import TransferEngine, TransportWrapper

if TYPE_CHECKING:
    from kvcake.server.worker.membership import WorkerMembership

log = logging.getLogger(__name__)


class Worker:
    """See the module docstring."""

    def __init__(self, config: WorkerConfig, *,
                 wrap_transport: TransportWrapper | None = None) -> None:
        """`wrap_transport`: the transfer engine's hook around every endpoint (tests)."""
        self.config = config
        self._wrap_transport = wrap_transport
        self.worker_id = config.worker_id or f"{config.role.value}-{uuid.uuid4().hex[:6]}"
        self.engine: Engine | None = None
        self.stage: StageEngine | None = None  # role cpp: its slice of the layers, no Engine
        self.transfer: TransferEngine | None = None
        self.store: StoreClient | None = None
        self.store_node: StoreNode | None = None
        self.membership: WorkerMembership | None = None
        self.kv_events: KvEventPublisher | None = None  # vLLM-format events (ZMQ PUB)
        self.counts = WorkerCounts()  # what its /metrics reports
        self.metrics_port: int | None = None
        self._metrics_server: Any = None
        self._role: WorkerRole | None = None
        self._listener: socket.socket | None = None
        self._link: MessageLink | None = None
        self._link_seq = 0  # the accept order of `_link`: only a later connection replaces it
        self._link_lock = threading.Lock()  # the accept side's threads swap `_link` under it
        self._inbox: queue.Queue[Any] = queue.Queue()  # messages, role-internal items, None
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()
        self.shutdown_requested = threading.Event()  # a frontend sent Shutdown
        self._last_load: LoadReport | None = None
        self._running = threading.Event()  # cleared by hold(): the engine loop stalls
        self._running.set()

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def address(self) -> str:
        if self._listener is None:
            raise RuntimeError("worker not started")
        host, port = self._listener.getsockname()[:2]
        return f"{host}:{port}"

    def start(self) -> Worker:
        """Load, mount and serve; on any failure what was started is stopped again."""
        try:
            return self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> Worker:
        cfg = self.config
        if cfg.num_threads is not None:
            import torch

            torch.set_num_threads(cfg.num_threads)
        self.transfer = transfer = components.transfer_engine(cfg, self._wrap_transport)
        self.engine, self.stage = components.load_model(cfg, transfer, self.worker_id)
        model = self._model()
        if self.engine is not None:
            self.kv_events = components.kv_event_publisher(cfg, self.worker_id, self.engine)
        transfer.start()
        self._serve_metrics(model)
        master = cfg.store_master
        if master is not None:
            self.store_node = components.store_node(cfg, master, self.worker_id, transfer)
            self.store = components.store_client(cfg, master, transfer, self.store_node)
        self._serve()
        if cfg.etcd is not None:  # checks the advertised address answers, then registers
            self.membership = components.etcd_membership(cfg, cfg.etcd, model)
            node = self.store_node
            self.membership.join(self, cfg.advertise_host,
                                 (node.node_id, transfer.address) if node else None)
        return self

    def _serve_metrics(self, model: Engine | StageEngine) -> None:
        cfg = self.config
        if cfg.metrics_port is not None:
            self.counts.num_blocks = model.block_manager.num_blocks
            labels = {"model_name": model.model_config.name, "worker_id": self.worker_id,
                      "role": cfg.role.value}
            self._metrics_server, self.metrics_port = serve_metrics(
                WorkerCollector(self.counts, labels), cfg.host, cfg.metrics_port)
            log.info("%s: /metrics on %s:%d", self.worker_id, cfg.host, self.metrics_port)

    def _serve(self) -> None:
        """The role, the control port and the accept and engine-loop threads."""
        cfg = self.config
        role: WorkerRole
        if cfg.role is Role.DECODE:
            role = DecodeRole(self)
        elif self.stage is not None:
            role = CppRole(self, self.stage)
        else:
            role = PrefillRole(self)
        self._role = role
        self._listener = socket.create_server((cfg.host, cfg.port))
        for target, name in ((self._accept_loop, "accept"), (self._engine_loop, "engine")):
            thread = threading.Thread(target=target, name=f"{self.worker_id}-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        role.start()

    def close(self) -> None:
        """Stop serving; running requests are dropped (the frontend sees the link close)."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self.membership is not None:  # leave etcd first: the frontend stops placing here
            self.membership.close()
        self._running.set()
        self._inbox.put(None)
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        with self._link_lock:
            link = self._link
        if link is not None:
            link.close()
        for thread in self._threads:
            thread.join(timeout=10)
        if self._role is not None:
            self._role.close()
        if self.kv_events is not None:  # its thread (the engine loop) has stopped
            self.kv_events.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        if self.store is not None:
            self.store.close()
        if self.store_node is not None:
            self.store_node.close()
        if self.transfer is not None:
            self.transfer.close()

    def __enter__(self) -> Worker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def hello(self) -> Hello:
        """Identity and KV layout (a CPP stage's pool holds its own layers only; the bytes per
        token are the whole model's, what a request's KV weighs)."""
        engine = self._model()
        itemsize = engine.pool.kv.element_size()
        role = self._role
        return Hello(
            worker_id=self.worker_id, role=self.config.role.value,
            model_name=engine.model_config.name, namespace=engine.namespace,
            block_size=engine.block_size, num_blocks=engine.block_manager.num_blocks,
            block_nbytes=engine.pool.block_nbytes, layer_nbytes=engine.pool.layer_nbytes,
            num_layers=engine.pool.num_layers,
            kv_bytes_per_token=engine.model_config.kv_bytes_per_token(itemsize),
            max_model_len=engine.max_model_len, vocab_size=engine.model_config.vocab_size,
            cpp_member=self.config.cpp_member,
            cpp_inbox=role.inbox.to_dict() if isinstance(role, CppRole) and role.inbox else None)

    def hold(self) -> None:
        """Fault injection: stall the engine loop (before its next iteration) until
        `release()`; the process stays up and its links stay open, like a hung worker."""
        self._running.clear()

    def release(self) -> None:
        self._running.set()

    def post(self, item: object) -> None:
        """Hand a role-internal item (e.g. a finished fetch) to the engine-loop thread."""
        self._inbox.put(item)

    def send(self, message: Message) -> None:
        """To the connected frontend; dropped when there is none (it fails the request)."""
        link = self._link
        if link is None or link.closed:
            return
        try:
            link.send(message)
        except OSError as exc:
            log.warning("%s: frontend link lost (%s)", self.worker_id, exc)

    def send_many(self, messages: list[Message]) -> None:
        """`send` of each, in order, as one write (one system call, one TCP segment)."""
        link = self._link
        if not messages or link is None or link.closed:
            return
        try:
            link.send_many(messages)
        except OSError as exc:
            log.warning("%s: frontend link lost (%s)", self.worker_id, exc)

    def _model(self) -> Engine | StageEngine:
        """The engine, or a CPP stage's slice of it: what identity and layout are read from."""
        model = self.engine or self.stage
        if model is None:
            raise RuntimeError("worker not started")
        return model

    def _active_role(self) -> WorkerRole:
        if self._role is None:
            raise RuntimeError("worker not started")
        return self._role

    # -- threads -----------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        assert self._listener is not None
        seq = 0
        while not self._stopping.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            seq += 1
            # The challenge runs on its own thread: a peer that never answers must not hold up
            # the frontend's reconnect behind it.
            threading.Thread(target=self._admit, args=(sock, seq), daemon=True,
                             name=f"{self.worker_id}-admit").start()

    def _admit(self, sock: socket.socket, seq: int) -> None:
        """A connection that fails the cluster-secret challenge is logged and closed before a
        byte of it is read as a message: the frontend's link and the engine are untouched.

        A newer connection (`seq`: accept order) replaces the link; an older one whose admission
        ends later is closed instead. Its Hello went out first, so its peer may already have
        closed it and connected again: without the order, this late thread would put the dead
        link back and close the live one (seen in CI: a test's link closed mid-request)."""
        if not auth.admit(sock, self.config.secret, auth.WORKER, log):
            sock.close()
            return
        try:
            link = MessageLink(sock)
            link.send(self.hello())
        except OSError:
            sock.close()
            return
        with self._link_lock:
            if self._stopping.is_set() or seq < self._link_seq:
                link.close()
                return
            old, self._link, self._link_seq = self._link, link, seq
        if old is not None:
            old.close()
        threading.Thread(target=self._read_loop, args=(link,), daemon=True,
                         name=f"{self.worker_id}-reader").start()

    def _read_loop(self, link: MessageLink) -> None:
        while True:
            try:
                message = link.recv()
            except MessageError as exc:
                log.warning("%s: bad message from the frontend, closing the link: %s",
                            self.worker_id, exc)
                link.close()
                return
            if message is None:
                return
            self._inbox.put(message)

    def _engine_loop(self) -> None:
        engine = self.engine  # None on a CPP stage: its role runs the chunks
        role = self._active_role()
        while True:
            idle = not (engine is not None and engine.has_unfinished()) and not role.has_pending()
            messages = self._drain(block=idle)
            self._running.wait()
            for message in messages:
                if isinstance(message, Ping):  # answered here: proves this loop turns
                    self.send(Pong(message.seq))
                    continue
                if isinstance(message, Shutdown):
                    self.shutdown_requested.set()  # the process owner (run_worker) stops
                    continue
                if message is None:
                    return
                try:
                    role.handle(message)
                except Exception:  # one bad order must not stop the worker
                    log.exception("%s: handling %s failed", self.worker_id,
                                  type(message).__name__)
            if engine.has_unfinished() if engine is not None else role.has_pending():
                role.step()
            role.after_step()
            self._publish()

    def _drain(self, block: bool) -> list[Any]:
        items = [self._inbox.get()] if block else []
        while True:
            try:
                items.append(self._inbox.get_nowait())
            except queue.Empty:
                return items

    def _publish(self) -> None:
        engine = self.engine
        if engine is None:  # a CPP stage: no prefix cache, its load only
            free = self._model().block_manager.num_free_blocks
            self._send_load(LoadReport(self._active_role().num_pending(), 0, free))
            return
        events = engine.drain_kv_events()
        if events:
            stored = [int(e.key) for e in events if e.kind.value == "stored"]
            removed = [int(e.key) for e in events if e.kind.value == "removed"]
            self.send(KvEvents(stored, removed))
            if self.kv_events is not None:
                self.kv_events.publish((e.kind.value == "stored", int(e.key)) for e in events)
            self.counts.blocks_stored += len(stored)
            self.counts.blocks_removed += len(removed)
        self._send_load(LoadReport(len(engine.batcher.waiting) + self._active_role().num_pending(),
                                   len(engine.batcher.running),
                                   engine.block_manager.num_free_blocks))

    def _send_load(self, load: LoadReport) -> None:
        self.counts.waiting, self.counts.running, self.counts.free_blocks = \
            load.num_waiting, load.num_running, load.num_free_blocks
        if load != self._last_load:
            self._last_load = load
            self.send(load)
