"""The Conductor's configuration: policy, admission, SLOs and the fetch threshold.

Frozen and validated; `from_dict` rejects unknown keys. The CLI takes its defaults from here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from enum import Enum, StrEnum
from typing import Any


class Policy(StrEnum):
    """How the prefill instance is chosen (the decode instance is always chosen by predicted TBT).

    RANDOM: uniformly at random (seeded).  LOAD_BALANCE: least queued prefill time.
    LOCAL_CACHE: least queue + prefill time using each instance's own prefix; never fetches.
    GLOBAL_CACHE: Algorithm 1 (seed section IX): may fetch the best prefix held anywhere.
    COLOCATED: every instance prefills and decodes (vLLM-like); like LOCAL_CACHE, and the decode
    instance is the chosen prefill instance itself.
    """

    RANDOM = "random"
    LOAD_BALANCE = "load_balance"
    LOCAL_CACHE = "local_cache"
    GLOBAL_CACHE = "global_cache"
    COLOCATED = "colocated"


class Admission(StrEnum):
    """When a request is rejected (HTTP 429) before any compute is spent.

    NONE: never. SLO: predicted TTFT > ttft_slo_s, or the decode instance's TBT *now* (with this
    request added) > tbt_slo_s. EARLY: as SLO, but the decode load is predicted for the moment
    this request's prefill would finish (requests that will have finished decoding by then are
    left out, requests placed earlier that will have joined by then are counted).
    """

    NONE = "none"
    SLO = "slo"
    EARLY = "early"


@dataclass(frozen=True)
class ConductorConfig:
    """Tunables of the Conductor.

    kvcache_balancing_threshold: fetch the best remote prefix when
        best_len > threshold * local_len (see `Conductor` for the local_len = 0 case); >= 1.
    ttft_slo_s, tbt_slo_s: the SLOs admission checks against (paper: 30 s; 0.1/0.2/0.3 s).
    transfer_bandwidth_bytes_per_s: KVCache loading speed of one fetch (the NIC of a node).
    fetch_only_if_faster: also require the fetch to beat recomputation in predicted time
        (Algorithm 1 as written decides by the threshold alone: False).
    index_on_placement: record a placed request's block keys on its prefill instance at once, as
        the paper does ("updates that instance's cache"), rather than only when the caller
        reports them with `on_blocks_stored`.
    min_retry_after_s: floor of the Retry-After estimate of a rejection.
    seed: seed of the RANDOM policy.
    """

    policy: Policy = Policy.GLOBAL_CACHE
    admission: Admission = Admission.EARLY
    kvcache_balancing_threshold: float = 1.5
    ttft_slo_s: float = 30.0
    tbt_slo_s: float = 0.1
    transfer_bandwidth_bytes_per_s: float = 100e9
    fetch_only_if_faster: bool = False
    index_on_placement: bool = True
    min_retry_after_s: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        # Accept the plain strings the CLI and config files carry.
        object.__setattr__(self, "policy", _enum(Policy, self.policy, "policy"))
        object.__setattr__(self, "admission", _enum(Admission, self.admission, "admission"))
        if not (math.isfinite(self.kvcache_balancing_threshold)
                and self.kvcache_balancing_threshold >= 1.0):
            raise ValueError("kvcache_balancing_threshold must be a finite number >= 1.0, got "
                             f"{self.kvcache_balancing_threshold!r}")
        for name in ("ttft_slo_s", "tbt_slo_s", "transfer_bandwidth_bytes_per_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and value > 0):
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        if not self.min_retry_after_s >= 0:
            raise ValueError(f"min_retry_after_s must be >= 0, got {self.min_retry_after_s!r}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ConductorConfig:
        """Build from a plain mapping (a config file section); unknown keys are errors."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown conductor config keys {unknown}; known: {sorted(known)}")
        return cls(**data)


def _enum(kind: type[Enum], value: object, field: str) -> Any:
    try:
        return kind(value)
    except ValueError:
        choices = ", ".join(str(member.value) for member in kind)
        raise ValueError(f"{field} must be one of {choices}; got {value!r}") from None
