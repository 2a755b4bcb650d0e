"""Transport faults switched on and off from outside a worker process (the chaos soak).

`kvcake worker` wraps its transfer engine's transports with `SwitchedFaultyTransport` when
`$KVCAKE_FAULTS_FILE` names a file path (never otherwise: without the variable nothing is
wrapped). While that file exists it holds a JSON `FaultSpec` ({"drop_rate": 0.05,
"delay_rate": 0.2, "delay_s": 0.05}) applied to every slice the worker moves (KV streamed to
decode workers, store reads and writes); when it is absent, no fault. The file is re-read at
most every `poll_s`.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

from kvcake.clock import Clock, SystemClock
from kvcake.transfer.faulty import FaultSpec, FaultyTransport
from kvcake.transfer.transport import Transport, TransportWrapper

ENV_VAR = "KVCAKE_FAULTS_FILE"
_KEYS = ("drop_rate", "delay_rate", "delay_s")
NO_FAULTS = FaultSpec()


class FaultSwitch:
    def __init__(self, path: str, poll_s: float = 0.5, clock: Clock | None = None) -> None:
        self.path = path
        self.poll_s = poll_s
        self._clock = clock or SystemClock()
        self._lock = threading.Lock()
        self._spec = NO_FAULTS
        self._read_at: float | None = None

    def spec(self) -> FaultSpec:
        now = self._clock.now_s()
        with self._lock:
            if self._read_at is None or now - self._read_at >= self.poll_s:
                self._read_at = now
                self._spec = self._read()
            return self._spec

    def _read(self) -> FaultSpec:
        try:
            with open(self.path) as f:
                raw: dict[str, Any] = json.load(f)
        except (OSError, ValueError):  # absent (off) or half-written: no faults this round
            return NO_FAULTS
        try:
            values: dict[str, Any] = {k: float(raw[k]) for k in _KEYS if k in raw}
            return FaultSpec(**values)
        except (TypeError, ValueError):
            return NO_FAULTS


class SwitchedFaultyTransport(FaultyTransport):
    """A `FaultyTransport` whose spec is the switch's current one."""

    def __init__(self, inner: Transport, switch: FaultSwitch, seed: int = 0) -> None:
        self._switch = switch
        super().__init__(inner, NO_FAULTS, seed)

    @property  # type: ignore[override]
    def spec(self) -> FaultSpec:
        return self._switch.spec()

    @spec.setter
    def spec(self, value: FaultSpec) -> None:  # FaultyTransport.__init__ sets it: ignored
        pass


def wrapper_from_env() -> TransportWrapper | None:
    """The transport wrapper `$KVCAKE_FAULTS_FILE` asks for, or None (the variable unset)."""
    path = os.environ.get(ENV_VAR)
    if not path:
        return None
    switch = FaultSwitch(path)
    return lambda transport, key, rail: SwitchedFaultyTransport(transport, switch, seed=rail)
