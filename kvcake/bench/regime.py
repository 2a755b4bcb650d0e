"""The paper's serving regime as hardware-free ratios, and a live experiment's parameters from them.

MOONCAKE's capacity experiment (LLaMA3-70B on 8xA800, the conversation trace) runs where:
- the mean prompt's cold prefill is ~1.44 s (the FLOPs model at 50% MFU) and a decode step
  ~45 ms (Figure 15b): prefill / decode step ~= 32;
- TBT SLOs are 100 / 200 / 300 ms ~= 2.2 / 4.4 / 6.6 decode steps;
- the TTFT SLO is 30 s ~= 21 mean prefills;
- the mean output is 343 tokens, i.e. a request decodes for ~343 steps.

`derive_regime` carries these ratios to another machine: given its measured decode step `s_d`
and its prefill time as a function of prompt length, the trace's prompts are scaled so that the
mean prompt's cold prefill is `PREFILL_STEPS` decode steps (capped at the model's context);
output lengths stay as the trace has them (capped), so a request's decode time relative to its
prefill is the paper's; the SLOs are the paper's in units of `s_d` and of the mean prefill.

The typical decode batch at which `s_d` is measured is fixed by the same ratios: one prefill
worker feeding one decode worker at utilisation rho hands it rho / (32 s_d) requests per second,
each decoding for `mean_output` steps of ~s_d, so by Little's law the decode batch is
rho * mean_output / 32 (independent of the hardware): 0.75 * 337 / 32 ~= 8.

Pure: no torch, no clock, no I/O.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

PREFILL_STEPS = 32.0  # mean cold prefill / decode step (1.44 s / 45 ms)
TBT_SLO_STEPS = (2.2, 4.4, 6.6)  # TBT SLOs in decode steps (100 / 200 / 300 ms over 45 ms)
TTFT_SLO_PREFILLS = 21.0  # TTFT SLO in mean prefills (30 s / 1.44 s)
MAX_OUTPUT_TOKENS = 1024  # output lengths are the trace's, capped here
TYPICAL_PREFILL_UTILISATION = 0.75  # rho of the typical-batch rule above


def typical_decode_batch(mean_output_len: float,
                         utilisation: float = TYPICAL_PREFILL_UTILISATION) -> int:
    """Little's law for 1P+1D at prefill utilisation rho: rho * mean_output / PREFILL_STEPS."""
    if not mean_output_len > 0 or not 0 < utilisation <= 1:
        raise ValueError(f"mean_output_len must be > 0 and utilisation in (0, 1], got "
                         f"{mean_output_len}, {utilisation}")
    return max(1, round(utilisation * mean_output_len / PREFILL_STEPS))


def tbt_slos_ms(s_d_s: float) -> tuple[float, ...]:
    """The paper's three TBT SLOs in milliseconds of this machine: 2.2 / 4.4 / 6.6 s_d."""
    if not s_d_s > 0:
        raise ValueError(f"s_d must be > 0 seconds, got {s_d_s}")
    return tuple(k * s_d_s * 1000.0 for k in TBT_SLO_STEPS)


def ttft_slo_s(mean_prefill_s: float) -> float:
    """The paper's TTFT SLO on this machine: 21 mean cold prefills."""
    if not mean_prefill_s > 0:
        raise ValueError(f"the mean prefill must be > 0 seconds, got {mean_prefill_s}")
    return TTFT_SLO_PREFILLS * mean_prefill_s


def solve_prompt_len(prefill_s: Callable[[int], float], target_s: float, max_len: int) -> int:
    """The prompt length whose cold prefill takes `target_s` (bisection on a non-decreasing
    `prefill_s`), capped at `max_len` (the context left after the output)."""
    if not target_s > 0 or max_len < 2:
        raise ValueError(f"target_s must be > 0 and max_len >= 2, got {target_s}, {max_len}")
    if prefill_s(max_len) <= target_s:
        return max_len
    low, high = 1, max_len  # prefill_s(high) > target_s
    while high - low > 1:
        mid = (low + high) // 2
        if prefill_s(mid) <= target_s:
            low = mid
        else:
            high = mid
    return low


def token_scale(target_len: int, mean_input_len: float) -> float:
    """The factor on every trace prompt length (and its 512-token hash block)."""
    if target_len < 1 or not mean_input_len > 0:
        raise ValueError(f"target_len must be >= 1 and mean_input_len > 0, got {target_len}, "
                         f"{mean_input_len}")
    return target_len / mean_input_len


@dataclass(frozen=True)
class Regime:
    """A live capacity experiment's parameters, fixed before any system runs."""

    s_d_s: float  # decode step of one decode worker at `decode_batch`
    decode_batch: int
    decode_context_tokens: int  # per sequence, at which s_d was taken
    mean_input_len: float  # of the replayed trace records, unscaled
    mean_output_len: float  # of the replayed records, capped at max_output_len
    target_prompt_len: int  # the scaled mean prompt: cold prefill ~= PREFILL_STEPS * s_d
    mean_prefill_s: float  # the cold prefill of target_prompt_len (measured model)
    prefill_tokens_per_s: float  # one prefill worker's throughput at that length
    scale_tokens: float
    max_prompt_len: int  # context - max_output_len: longer scaled prompts are cut
    max_output_len: int
    tbt_slos_ms: tuple[float, ...]
    ttft_slo_s: float
    num_requests: int  # trace records per replay
    max_probes: int  # capacity probes per TBT SLO

    def __post_init__(self) -> None:
        if not self.s_d_s > 0 or not self.scale_tokens > 0 or self.num_requests < 1 \
                or self.max_probes < 1:
            raise ValueError("regime: s_d_s, scale_tokens must be > 0; num_requests, max_probes "
                             ">= 1")
        object.__setattr__(self, "tbt_slos_ms", tuple(float(x) for x in self.tbt_slos_ms))

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Regime:
        data = json.loads(text)
        try:
            data["tbt_slos_ms"] = tuple(data["tbt_slos_ms"])
            return cls(**data)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a regime file ({exc}); write one with --measure-regime") \
                from None


@dataclass(frozen=True)
class Replay:
    """What a capacity experiment replays: the trace records' mean input length (unscaled) and
    their output lengths, the records per replay and the capacity probes per TBT SLO."""

    mean_input_len: float
    output_lens: Sequence[int]  # kept as a tuple
    num_requests: int
    max_probes: int

    def __post_init__(self) -> None:
        if not self.output_lens:
            raise ValueError("output_lens: give the replayed records' output lengths")
        object.__setattr__(self, "output_lens", tuple(self.output_lens))


def derive_regime(decode_step_s: Callable[[int, int], float], prefill_s: Callable[[int], float],
                  replay: Replay, max_model_len: int,
                  max_output_len: int = MAX_OUTPUT_TOKENS) -> Regime:
    """The regime of `replay` from this machine's measured models: `decode_step_s(batch,
    context_tokens)` (one decode worker) and `prefill_s(prompt_len)` (one prefill worker, cold).

    s_d is taken at the typical batch, each sequence holding the scaled mean prompt plus half the
    mean output; the scaled mean prompt depends on s_d, so the two are iterated to a fixed
    point (a few rounds: the context term is small)."""
    capped = [min(max(1, n), max_output_len) for n in replay.output_lens]
    mean_output = sum(capped) / len(capped)
    batch = typical_decode_batch(mean_output)
    max_prompt = max_model_len - max_output_len
    if max_prompt < 2:
        raise ValueError(f"max_model_len {max_model_len} leaves no room for prompts after "
                         f"{max_output_len} output tokens")
    target = min(max_prompt, 1024)
    s_d = 0.0
    for _ in range(8):
        context = target + math.ceil(mean_output / 2)
        s_d = decode_step_s(batch, batch * context)
        if not s_d > 0:
            raise ValueError(f"the decode step model gives {s_d} s at batch {batch}")
        new_target = solve_prompt_len(prefill_s, PREFILL_STEPS * s_d, max_prompt)
        if new_target == target:
            break
        target = new_target
    mean_prefill = prefill_s(target)
    return Regime(
        s_d_s=s_d, decode_batch=batch, decode_context_tokens=target + math.ceil(mean_output / 2),
        mean_input_len=replay.mean_input_len, mean_output_len=mean_output, target_prompt_len=target,
        mean_prefill_s=mean_prefill, prefill_tokens_per_s=target / mean_prefill,
        scale_tokens=token_scale(target, replay.mean_input_len), max_prompt_len=max_prompt,
        max_output_len=max_output_len, tbt_slos_ms=tbt_slos_ms(s_d),
        ttft_slo_s=ttft_slo_s(mean_prefill), num_requests=replay.num_requests,
        max_probes=replay.max_probes)
