"""The frontend's side of one worker: its link, load and liveness.

Liveness: `probe(now_s)` sends a `Ping` when none is outstanding and `ping_interval_s` has
passed, and says the worker is hung when the outstanding ping is older than
`worker_timeout_s`; `on_pong` clears it. Pure bookkeeping with the time passed in: the backend
calls it under its lock and acts on the answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvcake.auth import ClusterSecret
from kvcake.server.cluster.monitor import MonitorConfig
from kvcake.server.worker.link import MessageLink
from kvcake.server.worker.messages import (
    Hello,
    LoadReport,
    Message,
    MessageError,
    Ping,
    Shutdown,
)


@dataclass
class WorkerLink:
    hello: Hello
    link: MessageLink
    load: LoadReport | None = None
    alive: bool = True
    ping_seq: int = 0
    ping_sent_s: float | None = None  # the outstanding ping; None: answered
    last_ping_s: float | None = None

    @classmethod
    def of(cls, hello: Hello, link: MessageLink) -> WorkerLink:
        return cls(hello, link)

    @property
    def worker_id(self) -> str:
        return self.hello.worker_id

    def send(self, message: Message) -> bool:
        """False when the worker is gone (or was declared so). A send that fails (peer gone, or
        stalled past the link's send timeout, maybe mid-frame) closes the link: the reader then
        sees its end and the worker is declared lost the usual way."""
        if not self.alive:
            return False
        try:
            self.link.send(message)
        except OSError:
            self.link.close()
            return False
        return True

    def close(self, shutdown_worker: bool = False) -> None:
        """Disconnect; `shutdown_worker` first asks the worker process to exit."""
        if shutdown_worker:
            self.send(Shutdown())
        self.alive = False
        self.link.close()

    # -- liveness ------------------------------------------------------------------------------
    def probe(self, now_s: float, config: MonitorConfig) -> bool:
        """True when the worker is hung (its ping unanswered for worker_timeout_s); else sends
        the next ping when one is due."""
        if self.ping_sent_s is not None:
            return now_s - self.ping_sent_s > config.worker_timeout_s
        if self.last_ping_s is None or now_s - self.last_ping_s >= config.ping_interval_s:
            self.ping_seq += 1
            self.ping_sent_s = self.last_ping_s = now_s
            self.send(Ping(self.ping_seq))  # a dead link is noticed by its reader
        return False

    def on_pong(self, seq: int) -> None:
        if seq == self.ping_seq:
            self.ping_sent_s = None


def connect_workers(addresses: Sequence[str], send_timeout_s: float | None = None,
                    secret: ClusterSecret | None = None) -> list[WorkerLink]:
    """Connect to every worker and read its `Hello`; every worker must share the first one's KV
    layout (namespace, block size). ValueError naming the worker otherwise, with every link
    opened so far closed again. `send_timeout_s`: see `MessageLink.set_send_timeout` (the
    frontend sends under its one lock, so one stalled worker must not block it for good).
    `secret`: the cluster secret proved to every worker's control port (`kvcake.auth`)."""
    links: list[WorkerLink] = []
    try:
        for address in addresses:
            link = MessageLink.connect(address, secret=secret)
            if send_timeout_s is not None:
                link.set_send_timeout(send_timeout_s)
            try:
                first: Message | None = link.recv()
            except MessageError:
                first = None
            if not isinstance(first, Hello):
                link.close()
                hint = "" if secret is not None else (
                    "; it may ask for a cluster secret: configure the same one here "
                    "([security] secret_file / secret_env)")
                raise ValueError(f"worker {address}: expected Hello, got {first!r}{hint}")
            links.append(WorkerLink.of(first, link))
        layout = links[0].hello
        for view in links:
            hello = view.hello
            if (hello.namespace, hello.block_size) != (layout.namespace, layout.block_size):
                raise ValueError(f"worker {hello.worker_id}: KV namespace {hello.namespace!r} "
                                 f"differs from {layout.namespace!r}; run every worker "
                                 "with the same model, dtype, seed and block size")
    except BaseException:
        for view in links:
            view.link.close()
        raise
    return links
