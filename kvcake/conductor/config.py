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
    """When a request is rejected (HTTP 429), and on what forecast.

    NONE: never. SLO: at arrival, predicted TTFT > ttft_slo_s, or the decode instance's TBT *now*
    (with this request added) > tbt_slo_s: the paper's "early rejection" (arXiv version, section
    7), which looks at the decode load of the moment: each instance's outstanding load, its
    batch now plus the requests dispatched to it and not joined yet (in prefill, their KV
    promised), which it also chooses the instance by (`DecodeChoice.outstanding_at`). EARLY (also spelled "prediction"): as SLO,
    but the decode load is predicted for the moment this request's prefill would finish
    (requests predicted to have finished decoding by then are left out, requests placed earlier
    that will have joined by then are counted; under a uniform decode time t_d each joined
    request counts for [join, join + t_d), `DecodeLoad.batch_window`): the paper's
    prediction-based early rejection.
    DECODE_AFTER_PREFILL: the baseline both improve on: at arrival only the TTFT is checked; the
    decode side is asked when the prefill is done (`Conductor.admit_decode`), so a request
    rejected there has spent its prefill.
    """

    NONE = "none"
    SLO = "slo"
    EARLY = "early"
    DECODE_AFTER_PREFILL = "decode_after_prefill"

    @classmethod
    def _missing_(cls, value: object) -> Admission | None:
        return cls.EARLY if value == "prediction" else None


@dataclass(frozen=True)
class ConductorConfig:
    """Tunables of the Conductor.

    kvcache_balancing_threshold: fetch the best remote prefix when
        best_len > threshold * local_len (see `Conductor` for the local_len = 0 case); >= 1.
    ttft_slo_s, tbt_slo_s: the SLOs admission checks against (paper: 30 s; 0.1/0.2/0.3 s).
    transfer_bandwidth_bytes_per_s: KVCache loading speed of one fetch (the NIC of a node): the
        prior of the estimate that measured transfers (`Conductor.on_transfer_measured`) update.
    measured_bandwidth_weight: share of the newest measured transfer in the bandwidth estimate
        (an exponentially weighted moving average), in (0, 1]; the first one replaces the prior.
    min_measured_bytes: transfers smaller than this are not measurements (mostly latency).
    fetch_only_if_faster: also require the fetch to beat recomputation in predicted time
        (Algorithm 1 as written decides by the threshold alone: False).
    index_on_placement: count a placed request's blocks as its prefill instance's local prefix at
        once, as the paper does ("updates that instance's cache"): pending blocks (`PendingBlocks`),
        which no other instance may fetch until the caller reports them with `on_blocks_stored`.
        False: they count only once reported.
    min_retry_after_s: floor of the Retry-After estimate of a rejection.
    seed: seed of the RANDOM policy.
    uniform_decode_s: the decode forecast's `t_d`: every request is predicted to decode for this
        many seconds once it joins (the paper's prediction-based early rejection assumes a uniform
        decode time, since a request's output length is unknown). None: `max_output_len` steps of
        the predicted step time of the batch it joins.
    cpp_min_tokens: chunked pipeline parallelism (CPP, seed section VIII): a prompt of at least
        this many tokens is prefilled by a group of `cpp_nodes` prefill instances (the pool cut
        into consecutive groups, in pool order), its chunks pipelined across them. None: off.
    cpp_nodes: X, the prefill instances of one CPP group (>= 2 when CPP is on).
    cpp_chunk_tokens: tokens per pipelined chunk (the paper: at least 1,000).
    cpp_min_chunk_tokens: the smallest `cpp_chunk_tokens` accepted: the paper's 1,000 (smaller
        chunks leave each stage's forward too small to pay for the hand-off); lower it only for
        tests on tiny models.
    decode_kv_capacity_tokens: KV tokens one decode instance holds; a decode candidate whose
        forecast batch would not fit when each request reserves its prompt plus its whole
        max_output_len is predicted at TBT +inf (its requests would wait for memory). None: not
        checked.
    decode_check_after_prefill: under SLO and EARLY admission, ask the decode side again when
        the prefill ends (`Conductor.admit_decode`), as DECODE_AFTER_PREFILL does: the decode
        pool's own guard of the TBT SLO stays behind the early check, and a request the early
        check let through that finds decode full is rejected there, its prefill spent.
        False: the arrival decision is final (the request waits for decode memory).
    decode_check_keeps_node: the decode check after prefill asks only the decode instance
        chosen at arrival, where the KV was streamed during the prefill (the seed's workflow,
        steps 3-4): it decodes there if that instance's TBT meets the SLO, else it is rejected.
        Under DECODE_AFTER_PREFILL that arrival choice reads each instance's forecast at the
        request's predicted join time, as EARLY does (the requests in prefill booked to have
        joined by then counted), not its load now, under which a burst herds onto one node.
        False (the default): the instance is chosen again among all (its booking moves).
    prefill_speed_weight: the weight of each finished prefill (its measured duration, from its
        start to its end as the caller reports them, and its fitted prediction) in its
        instance's learned speed (`PrefillQueue.speed`: the ratio of the exponentially weighted
        means of the two; 1 until one finished); every prefill estimate of that instance (its
        queue, and a new request's prefill there) is then the fit times that speed. An
        instance slower than the fit (a colocated worker prefilling in small chunks beside its
        decodes, a host shared with other work) is then priced as it runs. 0 (the default):
        the fit as measured, Algorithm 1 as the paper.
        Measured live at 0.2 (docs/benchmarks.md, seventeenth session): the 1P+1D pair gained
        at loose TBT SLOs and lost at the tight one, two colocated workers lost at every SLO
        (their speeds follow the host's from minute to minute), so it stays off by default.
    """

    policy: Policy = Policy.GLOBAL_CACHE
    admission: Admission = Admission.EARLY
    kvcache_balancing_threshold: float = 1.5
    ttft_slo_s: float = 30.0
    tbt_slo_s: float = 0.1
    transfer_bandwidth_bytes_per_s: float = 100e9
    measured_bandwidth_weight: float = 0.5
    min_measured_bytes: int = 1 << 16
    fetch_only_if_faster: bool = False
    index_on_placement: bool = True
    min_retry_after_s: float = 1.0
    seed: int = 0
    uniform_decode_s: float | None = None
    cpp_min_tokens: int | None = None
    cpp_nodes: int = 2
    cpp_chunk_tokens: int = 1024
    cpp_min_chunk_tokens: int = 1000
    decode_kv_capacity_tokens: int | None = None
    decode_check_after_prefill: bool = False
    decode_check_keeps_node: bool = False
    prefill_speed_weight: float = 0.0

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
        if not (math.isfinite(self.measured_bandwidth_weight)
                and 0.0 < self.measured_bandwidth_weight <= 1.0):
            raise ValueError(f"measured_bandwidth_weight must be in (0, 1], "
                             f"got {self.measured_bandwidth_weight!r}")
        if not (math.isfinite(self.prefill_speed_weight)
                and 0.0 <= self.prefill_speed_weight <= 1.0):
            raise ValueError(f"prefill_speed_weight must be in [0, 1] (0: predictions as "
                             f"fitted), got {self.prefill_speed_weight!r}")
        if self.min_measured_bytes < 0:
            raise ValueError(f"min_measured_bytes must be >= 0, got {self.min_measured_bytes!r}")
        if not self.min_retry_after_s >= 0:
            raise ValueError(f"min_retry_after_s must be >= 0, got {self.min_retry_after_s!r}")
        if self.uniform_decode_s is not None and not (math.isfinite(self.uniform_decode_s)
                                                      and self.uniform_decode_s > 0):
            raise ValueError(f"uniform_decode_s must be a finite number > 0 (or unset), "
                             f"got {self.uniform_decode_s!r}")
        if self.cpp_min_tokens is not None and self.cpp_min_tokens < 1:
            raise ValueError(f"cpp_min_tokens must be >= 1 (or unset: CPP off), "
                             f"got {self.cpp_min_tokens!r}")
        if self.cpp_min_tokens is not None and self.cpp_nodes < 2:
            raise ValueError(f"cpp_nodes must be >= 2 when CPP is on (cpp_min_tokens set), "
                             f"got {self.cpp_nodes!r}")
        if self.decode_kv_capacity_tokens is not None and self.decode_kv_capacity_tokens < 1:
            raise ValueError(f"decode_kv_capacity_tokens must be >= 1 (or unset), "
                             f"got {self.decode_kv_capacity_tokens!r}")
        if self.cpp_min_chunk_tokens < 1:
            raise ValueError(f"cpp_min_chunk_tokens must be >= 1, got {self.cpp_min_chunk_tokens!r}")
        if self.cpp_chunk_tokens < self.cpp_min_chunk_tokens:
            raise ValueError(f"cpp_chunk_tokens must be >= {self.cpp_min_chunk_tokens} (CPP chunks "
                             f"of at least 1,000 tokens, as the paper; cpp_min_chunk_tokens lowers "
                             f"the floor), got {self.cpp_chunk_tokens!r}")

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
