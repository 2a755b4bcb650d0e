"""The simulated cluster's construction from a `SimConfig`: its cost model, the KV a decode node
holds, the prefill and decode instances with their names, and the Conductor over them.

Nodes: prefill instance i is node i, decode instance j is node num_prefill + j. Colocated
(vLLM-like) instances are all decode instances (`colocated=True`), each with an HBM prefix cache,
named alike on both sides of the Conductor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from kvcake.conductor import (
    Admission,
    Conductor,
    ConductorConfig,
    CostModel,
    Policy,
    PrefillModel,
    PrefillTimePredictor,
    profile_grid,
)
from kvcake.sim.cache import BlockLRU
from kvcake.sim.config import SimConfig
from kvcake.sim.decode import DecodeInstance, StepCosts
from kvcake.sim.prediction import NoisyPrefillModel
from kvcake.sim.prefill import PrefillInstance
from kvcake.sim.records import Arrival

_HBM_RESERVE = 0.9  # share of HBM left to weights + KV after activations and workspace


def cost_model(config: SimConfig) -> CostModel:
    """The cost model of `config`'s profile, with its hardware overrides applied."""
    cost = CostModel.from_spec(config.profile)
    if not config.hardware_overrides:
        return cost
    fields = {f.name for f in dataclasses.fields(cost.hardware)}
    unknown = sorted({name for name, _ in config.hardware_overrides} - fields)
    if unknown:
        raise ValueError(f"unknown hardware profile fields {unknown}; known: {sorted(fields)}")
    overrides: dict[str, Any] = dict(config.hardware_overrides)
    return CostModel(cost.model, dataclasses.replace(cost.hardware, **overrides))


def kv_capacity_tokens(cost: CostModel) -> int:
    """KV tokens one decode node holds: its HBM less the weights and the activation reserve."""
    return max(1, int((cost.hardware.hbm_bytes * _HBM_RESERVE - cost.model.weight_bytes)
                      // cost.model.kv_bytes_per_token))


def nic_bytes_per_s(config: SimConfig, cost: CostModel) -> float:
    """One node's NIC bandwidth: `config.nic_gbps` if set, else the hardware profile's."""
    if config.nic_gbps is None:
        return cost.hardware.nic_bandwidth_bytes_per_s
    return config.nic_gbps * 1e9 / 8


@dataclasses.dataclass
class Topology:
    """The instances of one run and the names the Conductor knows them by (colocated: one list,
    `prefills` empty, every instance in `decodes` with its HBM cache in `hbm_caches`)."""

    prefills: list[PrefillInstance]
    decodes: list[DecodeInstance]
    hbm_caches: list[BlockLRU]
    prefill_ids: list[str]
    decode_ids: list[str]


def build_topology(config: SimConfig, cost: CostModel, kv_capacity: int) -> Topology:
    """The instances `config` describes, each decode node holding `kv_capacity` KV tokens."""
    hw, block = cost.hardware, config.block_size
    busy_s = (getattr(cost, "decode_step_busy_time_s", None)  # a live profile's host coupling
              if getattr(cost, "host_coupled", False) and not config.colocated else None)
    costs = StepCosts(cost.decode_step_time_s, cost.prefill_time_s, cost.chunk_compute_s,
                      hw.prefill_step_overhead_s, busy_s)
    terms = getattr(cost, "colocated", None)  # a live profile's colocated step terms
    if config.colocated and terms is not None:
        costs = terms.step_costs(cost)
    if config.colocated:
        n = config.num_prefill + config.num_decode
        chunk_budget = config.chunk_budget_tokens if config.chunked_prefill else None
        decodes = [DecodeInstance(i, costs, kv_capacity, config.max_batch_size, colocated=True,
                                  chunk_budget_tokens=chunk_budget) for i in range(n)]
        caches = [BlockLRU(kv_capacity // block if config.prefix_cache else 0) for _ in range(n)]
        names = [f"colocated-{i}" for i in range(n)]
        return Topology([], decodes, caches, names, names)
    local_tokens = (hw.dram_bytes // cost.model.kv_bytes_per_token
                    if config.local_cache_tokens is None else config.local_cache_tokens)
    return Topology(
        [PrefillInstance(i, local_tokens // block) for i in range(config.num_prefill)],
        [DecodeInstance(i, costs, kv_capacity, config.max_batch_size)
         for i in range(config.num_decode)],
        [],
        [f"prefill-{i}" for i in range(config.num_prefill)],
        [f"decode-{i}" for i in range(config.num_decode)])


def told_output_len(config: SimConfig, arrivals: Sequence[Arrival]) -> int:
    """The one output length the Conductor is told for every request. It never sees a request's
    true output length (a live one knows max_tokens or a prediction): by default the trace's
    mean."""
    return config.predicted_output_len or max(1, round(
        sum(a.output_len for a in arrivals) / max(1, len(arrivals))))


def build_conductor(config: SimConfig, cost: CostModel, topology: Topology,
                    arrivals: Sequence[Arrival]) -> Conductor:
    """The unchanged Conductor over `topology`. It predicts prefill times with the paper's
    polynomial regression, fitted on profile points of the cost model over (at least) the
    trace's range of lengths."""
    max_input = max((a.input_len for a in arrivals), default=0)
    predictor: PrefillModel = PrefillTimePredictor.fit(profile_grid(cost, max(4096, max_input)))
    if config.prefill_prediction_error:
        predictor = NoisyPrefillModel(predictor, config.prefill_prediction_error, config.seed)
    conductor_config = ConductorConfig(
        policy=Policy(config.policy),
        admission=Admission.NONE if config.colocated else Admission(config.admission),
        kvcache_balancing_threshold=config.kvcache_balancing_threshold,
        ttft_slo_s=config.ttft_slo_s,
        tbt_slo_s=config.tbt_slo_ms / 1000.0,
        transfer_bandwidth_bytes_per_s=nic_bytes_per_s(config, cost),
        index_on_placement=config.prefix_cache or not config.colocated,
        seed=config.seed,
        uniform_decode_s=config.uniform_decode_s,
        cpp_min_tokens=config.cpp_min_tokens,
        cpp_nodes=config.cpp_nodes,
        cpp_chunk_tokens=config.cpp_chunk_tokens,
        decode_kv_capacity_tokens=kv_capacity_tokens(cost),
        decode_check_after_prefill=config.decode_check_after_prefill,
        decode_check_keeps_node=config.decode_check_keeps_node,
        prefill_speed_weight=config.prefill_speed_weight,
    )
    return Conductor(conductor_config, topology.prefill_ids, topology.decode_ids, predictor, cost,
                     cost.model.kv_bytes_per_token)
