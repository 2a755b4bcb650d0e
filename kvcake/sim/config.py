"""The simulated cluster's configuration: frozen, validated; the CLI takes its defaults from here.

Sizes left as None come from the hardware profile: a prefill node's local prefix cache is its
DRAM (1 TB holds ~3M llama3-70b tokens, the paper's figure), a decode instance's KV capacity is
its HBM less the weights and a 10% activation reserve, and a node's NIC is the profile's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from kvcake.conductor.config import Admission, Policy

POLICIES = tuple(p.value for p in Policy)
TRACE_BLOCK_SIZE = 512  # tokens per hash id in the published Mooncake traces


@dataclass(frozen=True)
class SimConfig:
    """One simulated run.

    num_prefill, num_decode: instances (nodes) per pool; with policy "colocated" all
        num_prefill + num_decode instances both prefill and decode (the same hardware budget).
    speed: arrival-time divisor (2.0 replays the trace twice as fast).
    max_requests: simulate only the first requests of the trace (None: all).
    local_cache_tokens: each prefill node's prefix cache (None: the node's DRAM).
    store_tokens: an extra pooled store tier (Mooncake Store on the decode nodes' DRAM) that every
        prefill writes its blocks to and any prefill may fetch from; 0 turns it off.
    nic_gbps: per-node NIC bandwidth, each direction (None: the profile's).
    chunked_prefill: colocated only: prefill chunks piggy-back on decode steps.
    chunk_budget_tokens: colocated chunked prefill: tokens per step (decodes included).
    prefix_cache: colocated only: keep a prefix cache in free HBM (vLLM prefix caching).
    max_batch_size: most sequences in one decode batch.
    hardware_overrides: (field, value) pairs replacing fields of the profile's hardware (e.g.
        (("attention_efficiency", 0.2),)): the sensitivity runs.
    predicted_output_len: the output length the Conductor is told (`max_output_len`): a live
        system knows only `max_tokens` or a prediction, never the true length. None: the trace's
        mean output length (what a live system learns from its history).
    uniform_decode_s: the Conductor's uniform decode-time forecast t_d (None: predicted steps).
    prefill_prediction_error: the Conductor's prefill-time predictions are multiplied by a
        seeded factor uniform in [1 - e, 1 + e] (a fixed factor per (prompt, prefix) length pair:
        the predictor stays a function); 0: the regression as fitted.
    cpp_min_tokens, cpp_nodes, cpp_chunk_tokens: chunked pipeline parallelism across prefill
        nodes (see `ConductorConfig`); cpp_min_tokens None: off.
    admission: the Conductor's admission mode; colocated runs never reject (vLLM has no
        admission control), so this only applies to the disaggregated policies.
    decode_check_after_prefill: admission "slo" / "early" also check the decode side when the
        prefill ends, rejecting there (prefill spent) as "decode_after_prefill" does; False: the
        arrival decision is final and a request waits for decode memory.
    decode_node_guard: with a decode check after prefill, the decode node itself must be able to
        start the request at once (its KV reserved beside the batch's and the requests already
        sent to it), or the request goes to a node that can, or is rejected there: the decode
        pool keeps its TBT SLO instead of queueing the request for memory (a wait that lands in
        the request's slowest token gaps). False: the Conductor's forecast alone decides. True
        also has the decode nodes report the KV they hold to the Conductor
        (`on_decode_kv`); without a decode check after prefill, that report is all it does.
    decode_reselect_at_handoff: where the arrival decision is final (no decode check after
        prefill), the decode instance chosen at arrival is the admission test, and the request
        is handed, when its prefill ends, to that instance if it can start it at once, else to
        the decode instance with the most room if that one can, else it waits at the one chosen
        at arrival; a moved request's KV is streamed again to its new node (the booking moves
        with it). The baseline (a decode check after prefill) re-chooses at hand-off anyway.
        False: bound to the instance chosen at arrival (the seed's "pre-selected").
    decode_check_keeps_node: the decode check after prefill (the baseline, or
        `decode_check_after_prefill`) asks only the decode instance chosen at arrival, where the
        KV was streamed during the prefill: the request decodes there if it fits (with
        `decode_node_guard`: if that node can start it at once), else it is rejected; the
        baseline pre-selects that node on the forecast at the request's predicted join time, as
        admission "early" does (`DecodeChoice.forecasts_join`). False: the decode instance is
        chosen again among all when the prefill ends.
    prefill_speed_weight: the Conductor's `prefill_speed_weight` (kvcake/conductor/config.py):
        each instance's prefill estimates at the speed its finished prefills showed (0: the fit).
    """

    num_prefill: int = 8
    num_decode: int = 8
    policy: str = "global_cache"
    profile: str = "llama3-70b@a800x8"
    speed: float = 1.0
    ttft_slo_s: float = 30.0
    tbt_slo_ms: float = 100.0
    seed: int = 0
    max_requests: int | None = None
    kvcache_balancing_threshold: float = 1.5
    admission: str = "early"
    local_cache_tokens: int | None = None
    store_tokens: int = 0
    nic_gbps: float | None = None
    chunked_prefill: bool = False
    chunk_budget_tokens: int = 512
    prefix_cache: bool = True
    max_batch_size: int = 256
    block_size: int = TRACE_BLOCK_SIZE
    hardware_overrides: tuple[tuple[str, float], ...] = ()
    predicted_output_len: int | None = None
    uniform_decode_s: float | None = None
    prefill_prediction_error: float = 0.0
    cpp_min_tokens: int | None = None
    cpp_nodes: int = 2
    cpp_chunk_tokens: int = 1024
    decode_check_after_prefill: bool = False
    decode_node_guard: bool = False
    decode_reselect_at_handoff: bool = False
    decode_check_keeps_node: bool = False
    prefill_speed_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {self.policy!r}")
        admissions = (*(a.value for a in Admission), "prediction")
        if self.admission not in admissions:
            raise ValueError(f"admission must be one of {', '.join(admissions)}; "
                             f"got {self.admission!r}")
        for name in ("num_prefill", "num_decode", "max_batch_size", "block_size"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        for name in ("speed", "ttft_slo_s", "tbt_slo_ms"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError(f"max_requests must be >= 1 (or unset), got {self.max_requests}")
        if self.local_cache_tokens is not None and self.local_cache_tokens < 0:
            raise ValueError(f"local_cache_tokens must be >= 0, got {self.local_cache_tokens}")
        if self.store_tokens < 0:
            raise ValueError(f"store_tokens must be >= 0 (0 turns the store tier off), "
                             f"got {self.store_tokens}")
        if self.nic_gbps is not None and not (math.isfinite(self.nic_gbps) and self.nic_gbps > 0):
            raise ValueError(f"nic_gbps must be a finite number > 0, got {self.nic_gbps}")
        if self.chunk_budget_tokens <= self.max_batch_size:
            raise ValueError(f"chunk_budget_tokens ({self.chunk_budget_tokens}) must exceed "
                             f"max_batch_size ({self.max_batch_size}); raise the budget or "
                             "lower --max-batch-size")
        if self.predicted_output_len is not None and self.predicted_output_len < 1:
            raise ValueError(f"predicted_output_len must be >= 1 (or unset), "
                             f"got {self.predicted_output_len}")
        if not 0 <= self.prefill_speed_weight <= 1:
            raise ValueError(f"prefill_speed_weight must be in [0, 1] (0: the fit as measured), "
                             f"got {self.prefill_speed_weight}")
        if not 0 <= self.prefill_prediction_error < 1:
            raise ValueError(f"prefill_prediction_error must be in [0, 1) (0.1 = +-10%), "
                             f"got {self.prefill_prediction_error}")
        if self.cpp_min_tokens is not None and self.cpp_min_tokens < 1:
            raise ValueError(f"cpp_min_tokens must be >= 1 (or unset: CPP off), "
                             f"got {self.cpp_min_tokens}")
        if self.cpp_min_tokens is not None and not 2 <= self.cpp_nodes <= self.num_prefill:
            raise ValueError(f"cpp_nodes must be in 2..num_prefill ({self.num_prefill}) when CPP "
                             f"is on, got {self.cpp_nodes}")
        if self.cpp_chunk_tokens < 1000:
            raise ValueError(f"cpp_chunk_tokens must be >= 1000 (the paper's chunks), "
                             f"got {self.cpp_chunk_tokens}")
        if not (math.isfinite(self.kvcache_balancing_threshold)
                and self.kvcache_balancing_threshold >= 1.0):
            raise ValueError("kvcache_balancing_threshold must be a finite number >= 1.0, got "
                             f"{self.kvcache_balancing_threshold!r}")

    @property
    def colocated(self) -> bool:
        return self.policy == Policy.COLOCATED.value

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SimConfig:
        """Build from a plain mapping; unknown keys are errors."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown simulator config keys {unknown}; known: {sorted(known)}")
        return cls(**data)
