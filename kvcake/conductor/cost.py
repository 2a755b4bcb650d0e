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
        """One prefill forward of tokens prefix_len..input_len: its FLOPs at the MFU of a forward
        that size, plus the per-forward overhead. Nothing to compute costs nothing."""
        new = input_len - prefix_len
        if new <= 0:
            _check_lengths(input_len, prefix_len)
            return 0.0
        hw = self.hardware
        return (self.prefill_flops(input_len, prefix_len) / (hw.peak_flops * hw.mfu_at(new))
                + hw.prefill_step_overhead_s)

    def chunk_compute_s(self, input_len: int, prefix_len: int, num_tokens: int,
                        forward_tokens: int) -> float:
        """Compute seconds of `num_tokens` of a prompt's prefill (its share of the prompt's
        FLOPs, tokens prefix_len..input_len) run inside a forward of `forward_tokens` tokens
        (a chunk riding with a decode batch); no per-forward overhead (the forward pays it)."""
        new = input_len - prefix_len
        if new <= 0 or num_tokens <= 0:
            return 0.0
        hw = self.hardware
        flops = self.prefill_flops(input_len, prefix_len) * num_tokens / new
        return flops / (hw.peak_flops * hw.mfu_at(max(num_tokens, forward_tokens)))

    def cpp_prefill_time_s(self, input_len: int, prefix_len: int, num_nodes: int,
                           chunk_tokens: int) -> float:
        """Chunked pipeline parallelism over `num_nodes` nodes (seed section VIII): the new tokens
        in J chunks of `chunk_tokens`, each node running 1/X of the layers; the pipeline takes
        (J + X - 1) stage times, a stage being one chunk's forward on 1/X of the layers (its
        share of the FLOPs at a chunk's MFU, plus a forward's overhead)."""
        new = input_len - prefix_len
        if new <= 0:
            _check_lengths(input_len, prefix_len)
            return 0.0
        hw = self.hardware
        num_chunks = -(-new // chunk_tokens)
        chunk = -(-new // num_chunks)
        compute_s = self.prefill_flops(input_len, prefix_len) / (hw.peak_flops * hw.mfu_at(chunk))
        stage_s = compute_s / num_chunks / num_nodes + hw.prefill_step_overhead_s / num_nodes
        return (num_chunks + num_nodes - 1) * stage_s

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

        The slower of reading the weights (at `hbm_efficiency`) plus the batch's KV (at
        `attention_efficiency`) from HBM, and computing 2 FLOPs per weight per sequence; plus the
        profile's fixed per-step overhead. An empty batch costs nothing.
        """
        if batch_size < 0 or context_tokens < 0:
            raise ValueError(f"batch_size and context_tokens must be >= 0, got "
                             f"{batch_size}, {context_tokens}")
        if batch_size == 0:
            return 0.0
        hw, m = self.hardware, self.model
        hbm = hw.hbm_bandwidth_bytes_per_s
        kv_bytes = context_tokens * m.kv_bytes_per_token
        if hw.attention_efficiency == hw.hbm_efficiency:  # one stream of bytes, one efficiency
            memory_s = (m.weight_bytes + kv_bytes) / (hbm * hw.hbm_efficiency)
        else:
            memory_s = (m.weight_bytes / (hbm * hw.hbm_efficiency)
                        + kv_bytes / (hbm * hw.attention_efficiency))
        compute_s = 2.0 * m.num_params * batch_size / (hw.peak_flops * hw.mfu)
        return (memory_s if memory_s > compute_s else compute_s) + hw.decode_step_overhead_s

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
