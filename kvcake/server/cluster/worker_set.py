"""The frontend's set of worker links: who is connected, who is alive, and the reader threads.

`connect()` opens a link to every worker (Hello handshake, layout check: worker_link.py);
`start_readers()` starts one daemon thread per link that hands each message to `on_message`
and calls `on_lost` once, when the link closes or sends something unreadable. A worker is never
removed from the set: a lost one stays with `alive = False`, so its late sends fail and its
replies are not read any more; `add()` takes a worker that joins later (etcd membership), or
one that rejoins under a lost worker's id.

Not thread-safe: the backend calls every method under its lock, except `close()` (after it has
failed what was in flight) and the callbacks, which the reader threads call without it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from kvcake.auth import ClusterSecret
from kvcake.server.cluster.monitor import MonitorConfig
from kvcake.server.cluster.worker_link import WorkerLink, connect_workers
from kvcake.server.worker.link import MessageLink
from kvcake.server.worker.messages import (
    Hello,
    LoadReport,
    Message,
    MessageError,
    Pong,
)

__all__ = ["WorkerSet"]

log = logging.getLogger(__name__)


class WorkerSet:
    def __init__(self) -> None:
        self._links: dict[str, WorkerLink] = {}
        self._readers: list[threading.Thread] = []
        self._on_message: Callable[[str, Message], None] = lambda worker_id, message: None
        self._on_lost: Callable[[str], None] = lambda worker_id: None

    def connect(self, addresses: Sequence[str],
                send_timeout_s: float | None = None,
                secret: ClusterSecret | None = None) -> list[Hello]:
        """Connect to every worker; returns their `Hello`s in address order (ValueError naming
        the worker when one does not share the first one's layout). A send to a worker that
        cannot go out within `send_timeout_s` fails and closes its link (`WorkerLink.send`)."""
        views = connect_workers(addresses, send_timeout_s, secret)
        self._links = {v.worker_id: v for v in views}
        return [v.hello for v in views]

    def start_readers(self, on_message: Callable[[str, Message], None],
                      on_lost: Callable[[str], None]) -> None:
        self._on_message, self._on_lost = on_message, on_lost
        for view in self._links.values():
            self._start_reader(view)

    def add(self, view: WorkerLink) -> None:
        """A worker that joined after `start_readers` (etcd membership): its link is read from
        now on. A lost worker of the same id is replaced (a restart rejoining)."""
        old = self._links.get(view.worker_id)
        if old is not None and old.alive:
            raise ValueError(f"worker {view.worker_id}: a live worker has this id already")
        self._links[view.worker_id] = view
        self._start_reader(view)

    def _start_reader(self, view: WorkerLink) -> None:
        reader = threading.Thread(target=self._read_loop,
                                  args=(view.worker_id, view.link, self._on_message,
                                        self._on_lost),
                                  name=f"frontend-{view.worker_id}", daemon=True)
        reader.start()
        self._readers = [r for r in self._readers if r.is_alive()]
        self._readers.append(reader)

    def close(self, shutdown_workers: bool = False) -> None:
        """Disconnect every link (`shutdown_workers`: ask each worker process to exit first)
        and wait for the readers."""
        for view in list(self._links.values()):
            view.close(shutdown_worker=shutdown_workers)
        for reader in self._readers:
            reader.join(timeout=5)

    # -- queries and sends (under the backend's lock) -----------------------------------------
    def get(self, worker_id: str) -> WorkerLink | None:
        return self._links.get(worker_id)

    def is_live(self, worker_id: str) -> bool:
        view = self._links.get(worker_id)
        return view is not None and view.alive

    def live_ids(self) -> list[str]:
        return [w for w, v in self._links.items() if v.alive]

    def send(self, worker_id: str, message: Message) -> bool:
        """False when the worker is unknown or gone (or was declared so)."""
        view = self._links.get(worker_id)
        return view is not None and view.send(message)

    def kv_cache_usage(self) -> float:
        """The fullest live worker's share of KV blocks in use (0 before any `LoadReport`)."""
        usage = [1 - v.load.num_free_blocks / v.hello.num_blocks
                 for v in self._links.values() if v.load is not None and v.alive]
        return max(usage, default=0.0)

    def on_report(self, worker_id: str, message: Message) -> bool:
        """Take a worker's report about itself (`LoadReport`, `Pong`); False for any other
        message (the caller routes it on)."""
        if isinstance(message, LoadReport):
            self._links[worker_id].load = message
            return True
        if isinstance(message, Pong):
            self._links[worker_id].on_pong(message.seq)
            return True
        return False

    # -- liveness ------------------------------------------------------------------------------
    def hung(self, now_s: float, config: MonitorConfig) -> list[str]:
        """Ping the live workers that are due one; returns those whose ping is unanswered for
        `worker_timeout_s` (their link stays open but their engine loop does not turn)."""
        return [w for w, v in self._links.items() if v.alive and v.probe(now_s, config)]

    def mark_lost(self, worker_id: str) -> bool:
        """Declare a live worker gone and close its link (a hung worker's late messages are not
        read any more). False when it is unknown or was lost already: nothing to do."""
        view = self._links.get(worker_id)
        if view is None or not view.alive:
            return False
        view.alive = False
        view.link.close()
        return True

    @staticmethod
    def _read_loop(worker_id: str, link: MessageLink, on_message: Callable[[str, Message], None],
                   on_lost: Callable[[str], None]) -> None:
        while True:
            try:
                message = link.recv()
            except MessageError as exc:
                log.warning("worker %s sent a bad message: %s", worker_id, exc)
                message = None
            if message is None:
                on_lost(worker_id)
                return
            on_message(worker_id, message)
