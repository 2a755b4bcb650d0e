"""A seeded generator of conversation-like traces in the Mooncake format.

Requests arrive as a Poisson process, or, with `burst_rate_factor` above 1, as a two-state
Markov-modulated Poisson process (MMPP): the rate alternates between a burst state (rate_per_s x
burst_rate_factor) and a calm state (rate_per_s x calm_rate_factor, the factor that keeps the
mean rate at rate_per_s), each state lasting an exponentially distributed time of mean
burst_mean_s / calm_mean_s (trace time: a replay at speed k divides them by k). Real traces
are bursty; a Poisson process at the same mean has none of their peaks. The same two states can
instead (or also) lengthen the outputs of the requests arriving in a burst
(`burst_output_factor`): bursts of decode demand at a steady prefill demand.

Each request either opens a new session (a chat that starts with one of a few global system
prompts, picked with Zipf-like popularity, then a first user message) or continues an open session: its prompt is the session's previous prompt, plus the
previous answer, plus a new user message. Hash ids are chained as in the published traces: full
blocks of a shared prefix keep their ids, every other block gets a fresh id. So the output has
the structure the scheduler cares about (hot system prompts, multi-turn prefix reuse) and runs
everything without ../shared/traces. Same config (seed included) -> byte-identical file.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, fields
from typing import Any

from kvcake.sim.trace import DEFAULT_BLOCK_SIZE, Trace, TraceRequest


@dataclass(frozen=True)
class TraceGenConfig:
    """Shape of a generated trace. Lengths in tokens; defaults resemble the conversation trace.

    burst_rate_factor: the arrival rate in a burst as a multiple of rate_per_s; 1 (the default)
        is a plain Poisson process (and the same bytes as before the MMPP existed).
    burst_mean_s, calm_mean_s: mean duration of a burst and of the calm between bursts, seconds
        of trace time (each duration exponential; the first state drawn from the stationary
        share burst_mean_s / (burst_mean_s + calm_mean_s)). Only read when burst_rate_factor or
        burst_output_factor is above 1.
    burst_output_factor: a request arriving in a burst has mean_output_len (and max_output_len)
        times this factor: bursts of decode demand (long generations) without more prefill
        demand when burst_rate_factor is 1. 1 (the default): the same lengths in both states.
    """

    num_requests: int = 1000
    rate_per_s: float = 3.4
    num_system_prompts: int = 8
    system_prompt_len: int = 1024
    mean_first_message_len: int = 9000
    mean_followup_len: int = 1500
    mean_output_len: int = 340
    max_output_len: int = 2000
    new_session_prob: float = 0.6
    max_turns: int = 8
    max_input_len: int = 128_000
    block_size: int = DEFAULT_BLOCK_SIZE
    seed: int = 0
    burst_rate_factor: float = 1.0
    burst_mean_s: float = 60.0
    calm_mean_s: float = 180.0
    burst_output_factor: float = 1.0

    def __post_init__(self) -> None:
        for name in ("num_requests", "num_system_prompts", "system_prompt_len",
                     "mean_first_message_len", "mean_followup_len", "mean_output_len",
                     "max_output_len", "max_turns", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.rate_per_s > 0:
            raise ValueError(f"rate_per_s must be > 0, got {self.rate_per_s}")
        if not 0 < self.new_session_prob <= 1:
            raise ValueError(f"new_session_prob must be in (0, 1], got {self.new_session_prob}")
        if self.max_input_len < self.system_prompt_len + 1:
            raise ValueError("max_input_len must exceed system_prompt_len")
        if not self.burst_rate_factor >= 1:
            raise ValueError(f"burst_rate_factor must be >= 1 (1: plain Poisson), "
                             f"got {self.burst_rate_factor}")
        if not self.burst_output_factor >= 1:
            raise ValueError(f"burst_output_factor must be >= 1 (1: the same output lengths in "
                             f"bursts), got {self.burst_output_factor}")
        if not (self.burst_mean_s > 0 and self.calm_mean_s > 0):
            raise ValueError(f"burst_mean_s and calm_mean_s must be > 0, got "
                             f"{self.burst_mean_s} and {self.calm_mean_s}")
        if self.calm_rate_factor < 0:
            raise ValueError(
                f"burst_rate_factor {self.burst_rate_factor} x burst share "
                f"{self.burst_share:.3f} exceeds 1: the calm rate would be negative; lower "
                f"burst_rate_factor or burst_mean_s, or raise calm_mean_s")

    @property
    def burst_share(self) -> float:
        """Long-run share of time in the burst state."""
        return self.burst_mean_s / (self.burst_mean_s + self.calm_mean_s)

    @property
    def calm_rate_factor(self) -> float:
        """The calm state's rate as a multiple of rate_per_s, so that the mean rate is
        rate_per_s: share x burst + (1 - share) x calm = 1."""
        share = self.burst_share
        return (1.0 - share * self.burst_rate_factor) / (1.0 - share)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TraceGenConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown trace generator keys {unknown}; known: {sorted(known)}")
        return cls(**data)


@dataclass
class _Session:
    length: int  # tokens of the last prompt
    full_ids: list[int]  # ids of the last prompt's full blocks
    last_output: int
    turns: int


class _Generator:
    def __init__(self, cfg: TraceGenConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.next_id = 0
        bs = cfg.block_size
        # System prompts: their full blocks are shared by every session that starts with them.
        self.system_ids = [self._fresh(cfg.system_prompt_len // bs) for _ in range(cfg.num_system_prompts)]
        self.weights = [1.0 / (k + 1) for k in range(cfg.num_system_prompts)]
        self.open: list[_Session] = []

    def _fresh(self, count: int) -> list[int]:
        ids = list(range(self.next_id, self.next_id + count))
        self.next_id += count
        return ids

    def _length(self, mean: int, upper: int) -> int:
        # Lognormal with the given mean and sigma 0.8: heavy-tailed like real prompts.
        sigma = 0.8
        value = self.rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)
        return max(1, min(upper, round(value)))

    def _prompt(self, prefix_len: int, prefix_ids: list[int], input_len: int) -> list[int]:
        bs = self.cfg.block_size
        kept = prefix_ids[: min(prefix_len, input_len) // bs]
        return kept + self._fresh(-(-input_len // bs) - len(kept))

    def request(self, index: int, timestamp_ms: int, output_factor: float = 1.0) -> TraceRequest:
        cfg, rng = self.cfg, self.rng
        if not self.open or rng.random() < cfg.new_session_prob:
            which = rng.choices(range(cfg.num_system_prompts), weights=self.weights)[0]
            budget = cfg.max_input_len - cfg.system_prompt_len
            input_len = cfg.system_prompt_len + self._length(cfg.mean_first_message_len, budget)
            ids = self._prompt(cfg.system_prompt_len, self.system_ids[which], input_len)
            session = _Session(input_len, [], 0, 0)
            self.open.append(session)
        else:
            session = self.open[rng.randrange(len(self.open))]
            grow = session.last_output + self._length(cfg.mean_followup_len, cfg.max_input_len)
            input_len = min(cfg.max_input_len, session.length + grow)
            ids = self._prompt(session.length, session.full_ids, input_len)
        output_len = self._length(round(cfg.mean_output_len * output_factor),
                                  round(cfg.max_output_len * output_factor))
        session.length, session.last_output = input_len, output_len
        session.full_ids = ids[: input_len // cfg.block_size]
        session.turns += 1
        if session.turns >= cfg.max_turns or input_len >= cfg.max_input_len:
            self.open.remove(session)
        return TraceRequest(index, float(timestamp_ms), input_len, output_len, tuple(ids))


class _Modulation:
    """The MMPP's rate over time: the state (burst or calm) and when it ends, drawn from its own
    seeded stream, so the requests' contents use the generator's stream exactly as a Poisson
    trace of the same seed does (same lengths and ids, other timestamps)."""

    def __init__(self, cfg: TraceGenConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(f"mmpp-{cfg.seed}")
        self.burst = self.rng.random() < cfg.burst_share
        self.ends_s = self._duration()

    def _duration(self) -> float:
        cfg = self.cfg
        return self.rng.expovariate(1.0 / (cfg.burst_mean_s if self.burst else cfg.calm_mean_s))

    def rate(self) -> float:
        cfg = self.cfg
        return cfg.rate_per_s * (cfg.burst_rate_factor if self.burst else cfg.calm_rate_factor)

    def advance(self, t_s: float, work: float) -> float:
        """The time at which `work` units of the integrated rate have passed after t_s (a
        unit-rate exponential `work` gives the next arrival of the modulated process)."""
        while True:
            rate = self.rate()
            if rate > 0 and rate * (self.ends_s - t_s) >= work:
                return t_s + work / rate
            work -= rate * (self.ends_s - t_s)
            t_s = self.ends_s
            self.burst = not self.burst
            self.ends_s = t_s + self._duration()


def generate_trace(cfg: TraceGenConfig) -> Trace:
    """A seeded conversation-like trace (integer millisecond timestamps)."""
    gen = _Generator(cfg)
    t_s = 0.0
    requests = []
    modulated = cfg.burst_rate_factor > 1 or cfg.burst_output_factor > 1
    modulation = _Modulation(cfg) if modulated else None
    for index in range(cfg.num_requests):
        factor = (cfg.burst_output_factor if modulation is not None and modulation.burst
                  else 1.0)
        requests.append(gen.request(index, round(t_s * 1000), factor))
        if modulation is None:
            t_s += gen.rng.expovariate(cfg.rate_per_s)
        else:  # one draw of the generator's stream per gap, as the Poisson case
            t_s = modulation.advance(t_s, gen.rng.expovariate(1.0))
    return Trace(tuple(requests), f"generated(seed={cfg.seed})", cfg.block_size)
