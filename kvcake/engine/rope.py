"""Rotary position embedding: the inverse frequencies (Llama-3 scaling included) and its
application to q / k on the eager path (the fused CPU path applies it in `rope_qkv_store`)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from kvcake.engine.config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> Tensor:
    """Inverse frequencies, with Llama-3 frequency-dependent scaling when configured."""
    dim = config.head_size
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    rs = config.rope_scaling
    if rs is None:
        return inv_freq.float()
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor)
    mid = (1 - smooth) * scaled / rs.factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, mid, scaled).float()


def apply_rope(x: Tensor, cos: Tensor, sin_half: Tensor) -> Tensor:
    """x * cos + rotate_half(x) * sin, without building rotate_half(x): the two halves of sin
    are equal (the frequencies are repeated), so each half of the result is one fused
    multiply-add on top of x * cos."""
    half = x.shape[-1] // 2
    out = x * cos
    out[..., :half].addcmul_(x[..., half:], sin_half, value=-1.0)
    out[..., half:].addcmul_(x[..., :half], sin_half)
    return out
