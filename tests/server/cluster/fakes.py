"""A fake worker for the frontend's parts (worker_set, flights): a real control port
that says `Hello`, records what the frontend sends and sends what the test tells it to. No
engine behind it, so each test states every worker reply itself, in a fixed order.

Absence is checked without sleeping: `probe()` sends a marker down the same ordered link after
the action, so "the next message is the marker" means nothing was sent before it.
"""

from __future__ import annotations

import queue
import socket
import threading

from kvcake.conductor.predictor import DecodeStepPredictor, PrefillTimePredictor
from kvcake.server.cluster.worker_set import WorkerSet
from kvcake.server.worker.link import MessageLink
from kvcake.server.worker.messages import Hello, Message, Ping

BLOCK_SIZE = 16
NUM_BLOCKS = 64
# The Conductor's time models for these workers (any fixed fit will do: no SLO is tight here).
PREFILL = PrefillTimePredictor(1, 1.0, [0.0, 0.001, -0.001])
DECODE = DecodeStepPredictor([0.01, 0.001, 0.0])


def hello(worker_id: str, role: str, namespace: str = "kvcake/tiny/test/b16") -> Hello:
    return Hello(worker_id=worker_id, role=role, model_name="tiny", namespace=namespace,
                 block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, block_nbytes=4096,
                 layer_nbytes=2048, num_layers=2, kv_bytes_per_token=256, max_model_len=512,
                 vocab_size=256)


class FakeWorker:
    def __init__(self, worker_id: str, role: str) -> None:
        self.hello = hello(worker_id, role)
        self._server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._server.getsockname()[1]}"
        self.received: queue.Queue[Message] = queue.Queue()
        self._link: MessageLink | None = None
        self._connected = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"fake-{worker_id}",
                                        daemon=True)
        self._probes = 0

    def start(self) -> FakeWorker:
        self._thread.start()
        return self

    def _serve(self) -> None:
        conn, _ = self._server.accept()
        self._link = MessageLink(conn)
        self._link.send(self.hello)
        self._connected.set()
        while (message := self._link.recv()) is not None:
            self.received.put(message)

    def next(self, timeout_s: float = 10.0) -> Message:
        return self.received.get(timeout=timeout_s)

    def send(self, message: Message) -> None:
        assert self._connected.wait(10.0)
        assert self._link is not None
        self._link.send(message)

    def probe(self, workers: WorkerSet) -> Message:
        """Send a marker through the frontend's link to this worker; returns the first message
        this worker received from now on (the marker itself when nothing came before it)."""
        self._probes += 1
        marker = Ping(10_000 + self._probes)
        assert workers.send(self.hello.worker_id, marker)
        first = self.next()
        if first != marker:  # drain up to the marker, so the next check starts clean
            while self.next() != marker:
                pass
        return first

    def wait_disconnected(self, timeout_s: float = 10.0) -> bool:
        """True once the frontend closed its link to this worker (this side saw the end)."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def close(self) -> None:
        """Drop the link (the frontend's reader sees its end) and stop serving."""
        if self._link is not None:
            self._link.close()
        self._server.close()
        self._thread.join(timeout=10)
