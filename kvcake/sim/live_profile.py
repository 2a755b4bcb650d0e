"""A cost model fitted on the live engine, for `kvcake simulate --live-profile FILE`.

FILE is `kvcake profile`'s JSON (the fitted prefill regression `prefill`, the decode step model
`decode`, and their measured points) with one more object, `live`, that says what the profile
alone does not:

    "live": {"transfer_bandwidth_bytes_per_s": 2.1e9,   # measured KV hand-off bytes / s
             "kv_pool_tokens": 262144,                  # one worker's KV pool, in tokens
             "shape": {"num_layers": 4, "hidden_size": 512, "num_heads": 8,
                       "num_kv_heads": 2, "intermediate_size": 1408, "vocab_size": 32000},
             "dtype_bytes": 4,
             "topology": {"num_prefill": 1, "num_decode": 1},   # optional, informational
             "contention": {"decode": 1.6, "prefill": 1.3,      # optional, default 1.0 each
                            "decode_prefill_busy": 2.0,         # optional, default: "decode"
                            "prefill_decode_busy": 1.8},        # optional, default: "prefill"
             "decode_step_overhead_s": 0.0005,          # optional, default 0
             "colocated": {...}}                        # optional: colocated_cost.py

`LiveCost` answers what the simulator asks of a `CostModel` from those fits instead of FLOPs:
a prefill is `prefill.predict(input, prefix)` (a chunk of it inside a larger forward: its
share by tokens), a decode step `decode.decode_step_time_s(batch, context)`, a transfer the
measured bandwidth; a decode node holds `kv_pool_tokens` of KV and a prefill node caches as
many (the live worker's prefix cache is its KV pool).

`contention`: the fits are measured on one engine alone; live, a worker shares the host's cores
and memory with the cluster's other processes (on one 2-core host: the prefill and decode
workers, the frontend, the client, and anything else running), and its steps take longer than
the isolated fit says. `decode` multiplies every decode step, `prefill` every prefill (and
prefill chunk): one factor each per host, fitted from a live run at one rate
(`benchmarks/sim_vs_live.py --fit-rate`) or measured from a live step trace
(`benchmarks/decode_gaps.py`: each decode step's wall time over the fit) and checked at another.
`decode_prefill_busy`: the decode factor while the host's prefill worker computes (on a 2-core
host the prefill and decode workers, the frontend and the client share the cores: a decode step
is slowest while a prefill runs beside it); `decode` then holds while no prefill runs. The
simulator switches between the two at the decode run's next step boundary when a prefill
starts or ends (disaggregated clusters: every prefill instance shares the host with every
decode instance, as the live 1P+1D does). `prefill_decode_busy` is the other half: the prefill
factor when the prefill starts while the host's decode worker has a batch (`prefill` then holds
for a prefill that starts while it has none); decided when the prefill starts.

`decode_step_overhead_s`: seconds the live decode worker spends per step outside the engine
step the fit timed (sending the step's tokens, its loop: inbox, orders, load report), measured
from the step trace (the gap from one step's end to the next one's start, back-to-back steps);
added to every decode step.

`colocated`: the colocated workers' step terms (`ColocatedTerms`, kvcake/sim/colocated_cost.py:
decode factors and chunk factors, a chunk-only step's and a mixed step's, with the host's other
worker idle / stepping, a per-step overhead; optionally `by_rows`, the decode and mixed-chunk
factors per decode-row bucket),
used for colocated runs instead of `contention` and `decode_step_overhead_s`.

Pure: no torch, no clock; `load_live_profile` reads one file.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from kvcake.conductor import CostModel, DecodeStepPredictor, PrefillTimePredictor
from kvcake.conductor.profiles import HardwareProfile, ModelProfile
from kvcake.sim.colocated_cost import ColocatedTerms

_HBM_RESERVE = 0.9  # kvcake/sim/topology.py keeps this share of HBM for weights + KV
_SHAPE_KEYS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "intermediate_size",
               "vocab_size")


@dataclass(frozen=True)
class LiveCost:
    """`CostModel`'s interface (as the simulator and the Conductor use it) from live fits."""

    model: ModelProfile
    hardware: HardwareProfile
    prefill: PrefillTimePredictor
    decode: DecodeStepPredictor
    kv_pool_tokens: int
    topology: tuple[tuple[str, int], ...] = ()
    decode_contention: float = 1.0  # live step / isolated fit, decode steps
    prefill_contention: float = 1.0  # the same for prefills
    decode_busy_contention: float | None = None  # decode steps while the host prefills
    prefill_busy_contention: float | None = None  # prefills started while the host decodes
    decode_step_overhead_s: float = 0.0  # the worker's time per step outside the engine step
    colocated: ColocatedTerms | None = None  # the colocated workers' step terms

    def __post_init__(self) -> None:
        for name, key in (("decode_contention", "decode"), ("prefill_contention", "prefill"),
                          ("decode_busy_contention", "decode_prefill_busy"),
                          ("prefill_busy_contention", "prefill_decode_busy")):
            value = getattr(self, name)
            if name.endswith("busy_contention") and value is None:
                continue
            if not (isinstance(value, (int, float)) and 0 < value < math.inf):
                raise ValueError(f"live.contention: {key} must be a positive "
                                 f"finite factor (1.0: no contention), got {value!r}")
        overhead = self.decode_step_overhead_s
        if not (isinstance(overhead, (int, float)) and 0 <= overhead < math.inf):
            raise ValueError("live.decode_step_overhead_s must be finite seconds >= 0, got "
                             f"{overhead!r}")

    @property
    def host_coupled(self) -> bool:
        """Whether a decode step's cost depends on the host's prefill worker computing."""
        return self.decode_busy_contention is not None

    @property
    def prefill_busy_ratio(self) -> float | None:
        """A prefill started while the host decodes takes this many times `prefill_time_s`
        (None: no such coupling)."""
        if self.prefill_busy_contention is None:
            return None
        return self.prefill_busy_contention / self.prefill_contention

    def prefill_time_s(self, input_len: int, prefix_len: int = 0) -> float:
        if not 0 <= prefix_len <= input_len:
            raise ValueError(f"prefix_len must be in [0, input_len={input_len}], got {prefix_len}")
        if input_len - prefix_len <= 0:
            return 0.0
        return max(0.0, self.prefill.predict(input_len, prefix_len)) * self.prefill_contention

    def chunk_compute_s(self, input_len: int, prefix_len: int, num_tokens: int,
                        forward_tokens: int) -> float:
        """Its share by tokens of the prompt's measured prefill (the forward's size is not in the
        fit: a chunk costs the same inside a decode batch as alone)."""
        new = input_len - prefix_len
        if new <= 0 or num_tokens <= 0:
            return 0.0
        return self.prefill_time_s(input_len, prefix_len) * num_tokens / new

    def cpp_prefill_time_s(self, input_len: int, prefix_len: int, num_nodes: int,
                           chunk_tokens: int) -> float:
        """(J + X - 1) / (J X) of the single-node prefill (J chunks, X nodes)."""
        new = input_len - prefix_len
        if new <= 0:
            return 0.0
        chunks = -(-new // chunk_tokens)
        return (self.prefill_time_s(input_len, prefix_len) * (chunks + num_nodes - 1)
                / (chunks * num_nodes))

    def predict(self, input_len: int, prefix_len: int) -> float:
        return self.prefill_time_s(input_len, prefix_len)

    def kv_bytes(self, num_tokens: int) -> int:
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return num_tokens * self.model.kv_bytes_per_token

    def decode_step_time_s(self, batch_size: int, context_tokens: int) -> float:
        """A decode step while the host's prefill worker is idle (or always, uncoupled)."""
        if batch_size == 0:
            return 0.0
        return (self.decode.decode_step_time_s(batch_size, context_tokens)
                * self.decode_contention + self.decode_step_overhead_s)

    def decode_step_busy_time_s(self, batch_size: int, context_tokens: int) -> float:
        """A decode step while the host's prefill worker computes (`decode_prefill_busy`)."""
        if batch_size == 0:
            return 0.0
        factor = (self.decode_contention if self.decode_busy_contention is None
                  else self.decode_busy_contention)
        return (self.decode.decode_step_time_s(batch_size, context_tokens) * factor
                + self.decode_step_overhead_s)

    def as_cost_model(self) -> CostModel:
        """Itself, typed as what `simulate(cost=...)` takes (it answers the same calls)."""
        return cast(CostModel, self)

    def transfer_time_s(self, num_bytes: int, bandwidth_bytes_per_s: float | None = None) -> float:
        bandwidth = bandwidth_bytes_per_s or self.hardware.nic_bandwidth_bytes_per_s
        if num_bytes < 0:
            raise ValueError(f"num_bytes must be >= 0, got {num_bytes}")
        return num_bytes / bandwidth


def live_cost_from_dict(data: dict[str, Any], source: str = "live profile") -> LiveCost:
    """The cost model of one `kvcake profile` JSON object with its `live` section."""
    try:
        prefill = PrefillTimePredictor.from_json(json.dumps(data["prefill"]))
        decode = DecodeStepPredictor.from_json(json.dumps(data["decode"]))
        live = data["live"]
        bandwidth = float(live["transfer_bandwidth_bytes_per_s"])
        pool_tokens = int(live["kv_pool_tokens"])
        shape = {k: int(live["shape"][k]) for k in _SHAPE_KEYS}
        dtype_bytes = int(live.get("dtype_bytes", 4))
        topology = tuple(sorted((str(k), int(v)) for k, v in live.get("topology", {}).items()))
        contention = live.get("contention", {})
        if not isinstance(contention, dict) or \
                set(contention) - {"decode", "prefill", "decode_prefill_busy",
                                   "prefill_decode_busy"}:
            raise ValueError("live.contention: expected {\"decode\": x, \"prefill\": y, "
                             "\"decode_prefill_busy\": z, \"prefill_decode_busy\": w} "
                             f"(positive factors, all optional), got {contention!r}")
        decode_factor = float(contention.get("decode", 1.0))
        prefill_factor = float(contention.get("prefill", 1.0))
        busy = contention.get("decode_prefill_busy")
        busy_factor = None if busy is None else float(busy)
        prefill_busy = contention.get("prefill_decode_busy")
        prefill_busy_factor = None if prefill_busy is None else float(prefill_busy)
        overhead = float(live.get("decode_step_overhead_s", 0.0))
        colocated = (None if live.get("colocated") is None
                     else ColocatedTerms.from_dict(live["colocated"]))
    except KeyError as exc:
        raise ValueError(f"{source}: missing {exc}; a live profile is `kvcake profile`'s JSON "
                         "plus a \"live\" object (kvcake/sim/live_profile.py)") from None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{source}: {exc}") from None
    if not bandwidth > 0 or pool_tokens < 1:
        raise ValueError(f"{source}: live.transfer_bandwidth_bytes_per_s must be > 0 and "
                         f"live.kv_pool_tokens >= 1, got {bandwidth}, {pool_tokens}")
    model = ModelProfile(str(data.get("model", "live")), dtype_bytes=dtype_bytes, **shape)
    pool_bytes = pool_tokens * model.kv_bytes_per_token
    hardware = HardwareProfile(
        "live", peak_flops=1.0, mfu=1.0, hbm_bandwidth_bytes_per_s=1.0, hbm_efficiency=1.0,
        nic_bandwidth_bytes_per_s=bandwidth,
        # the simulator's decode KV capacity is (hbm * 0.9 - weights) / kv per token: the pool
        hbm_bytes=math.ceil((pool_bytes + model.weight_bytes + model.kv_bytes_per_token / 2)
                            / _HBM_RESERVE),
        dram_bytes=pool_bytes)
    return LiveCost(model, hardware, prefill, decode, pool_tokens, topology,
                    decode_contention=decode_factor, prefill_contention=prefill_factor,
                    decode_busy_contention=busy_factor, decode_step_overhead_s=overhead,
                    prefill_busy_contention=prefill_busy_factor, colocated=colocated)


def load_live_profile(path: str | Path) -> LiveCost:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--live-profile {path}: cannot read it ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"--live-profile {path}: expected a JSON object")
    return live_cost_from_dict(data, f"--live-profile {path}")
