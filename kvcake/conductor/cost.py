"""Analytic cost model: FLOPs and bytes of prefill, decode and KVCache transfer, in seconds.

The same formulas drive the simulator (from a hardware profile) and give the Conductor its
default estimates; the live cluster fits `PrefillTimePredictor` on measured times instead.

Pure: no torch, no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcake.conductor.profiles import HardwareProfile, ModelProfile, parse_profile


def _check_lengths(input_len: int, prefix_len: int) -> None:
    if input_len < 0:
        raise ValueError(f"input_len must be >= 0, got {input_len}")
    if not 0 <= prefix_len <= input_len:
        raise ValueError(f"prefix_len must be in [0, input_len={input_len}], got {prefix_len}")


@dataclass(frozen=True)
class CostModel:
    """Seconds for prefill, decode steps and transfers of `model` on one `hardware` instance.

    Satisfies the Conductor's `PrefillModel` (`predict`) and `DecodeModel`
    (`decode_step_time_s`, `kv_bytes`) protocols.
    """

    model: ModelProfile
    hardware: HardwareProfile

    @classmethod
    def from_spec(cls, spec: str) -> CostModel:
        """`CostModel.from_spec("llama3-70b@a800x8")`; unknown names raise ValueError."""
        model, hardware = parse_profile(spec)
        return cls(model, hardware)

    def prefill_flops(self, input_len: int, prefix_len: int = 0) -> float:
        """FLOPs of tokens prefix_len..input_len, each attending to all input_len tokens.

        l * (a * (n - p) * n * d + b * (n - p) * d^2); with p = 0 this is the paper's
        l * (a n^2 d + b n d^2).
        """
        _check_lengths(input_len, prefix_len)
        m = self.model
        new, d = input_len - prefix_len, m.hidden_size
        return float(m.num_layers) * (m.attn_coeff * new * input_len * d + m.linear_coeff * new * d * d)

    def prefill_time_s(self, input_len: int, prefix_len: int = 0) -> float:
        """Prefill compute time at the profile's MFU."""
        return self.prefill_flops(input_len, prefix_len) / (self.hardware.peak_flops * self.hardware.mfu)

    def predict(self, input_len: int, prefix_len: int) -> float:
        """`PrefillModel` protocol: the exact analytic prefill time."""
        return self.prefill_time_s(input_len, prefix_len)

    def kv_bytes(self, num_tokens: int) -> int:
        """Bytes of the KVCache of `num_tokens` tokens (all layers, K and V)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return num_tokens * self.model.kv_bytes_per_token

    def decode_step_time_s(self, batch_size: int, context_tokens: int) -> float:
        """One decode step of `batch_size` sequences holding `context_tokens` KV tokens in all.

        Roofline: the slower of reading the weights plus the batch's KV from HBM and computing
        2 FLOPs per weight per sequence. An empty batch costs nothing.
        """
        if batch_size < 0 or context_tokens < 0:
            raise ValueError(f"batch_size and context_tokens must be >= 0, got "
                             f"{batch_size}, {context_tokens}")
        if batch_size == 0:
            return 0.0
        hw, m = self.hardware, self.model
        read_bytes = m.weight_bytes + context_tokens * m.kv_bytes_per_token
        memory_s = read_bytes / (hw.hbm_bandwidth_bytes_per_s * hw.hbm_efficiency)
        compute_s = 2.0 * m.num_params * batch_size / (hw.peak_flops * hw.mfu)
        return memory_s if memory_s > compute_s else compute_s

    def transfer_time_s(self, num_bytes: int, bandwidth_bytes_per_s: float | None = None) -> float:
        """Bytes over a link; by default the instance's NIC bandwidth."""
        bandwidth = self.hardware.nic_bandwidth_bytes_per_s if bandwidth_bytes_per_s is None \
            else bandwidth_bytes_per_s
        if bandwidth <= 0:
            raise ValueError(f"bandwidth_bytes_per_s must be > 0, got {bandwidth}")
        if num_bytes < 0:
            raise ValueError(f"num_bytes must be >= 0, got {num_bytes}")
        return num_bytes / bandwidth

    def min_reuse_bandwidth_bytes_per_s(self, prefix_len: int, use_mfu: bool = False) -> float:
        """The B/G criterion: the loading speed B above which reusing a prefix beats recomputing it.

        Reuse pays when p*l*(2d/gqa)*s / B < l*(a p^2 d + b p d^2) / G, i.e.
        B > G * (2d/gqa)*s / (a p d + b d^2). With G the peak FLOP/s (as the paper does) this is
        ~6 GB/s for llama3-70b on 8xA800 at p = 8192; `use_mfu` uses the achieved FLOP/s instead.
        """
        if prefix_len < 1:
            raise ValueError(f"prefix_len must be >= 1, got {prefix_len}")
        m, hw = self.model, self.hardware
        g = hw.peak_flops * (hw.mfu if use_mfu else 1.0)
        d = m.hidden_size
        per_token_layer_bytes = m.kv_bytes_per_token / m.num_layers
        return g * per_token_layer_bytes / (m.attn_coeff * prefix_len * d + m.linear_coeff * d * d)
