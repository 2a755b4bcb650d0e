"""Model shapes (presets and Hugging Face `config.json`) and the engine's own settings.

Both are frozen dataclasses validated on construction; a bad value raises ValueError naming the
field. `ModelConfig.from_hf_dict` reads the subset of a Llama `config.json` the engine uses and
rejects model types it cannot run. Presets `llama3-8b` and `llama3-70b` exist for cost models
only: `ModelConfig.instantiable` is False for them and the engine refuses to build them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

# Llama-family checkpoints that differ only in config: Mistral (sliding window: contexts are
# capped at it, so attention is exact), Qwen2 (biases on q, k and v, not on o_proj).
_SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                  "qwen2": "Qwen2ForCausalLM"}
_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent RoPE scaling (`rope_type == "llama3"`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_position_embeddings: int
    head_dim: int | None = None  # None: hidden_size // num_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # biases on q, k, v and o_proj (Llama's attention_bias)
    qkv_bias: bool = False  # biases on q, k and v only (Qwen2)
    mlp_bias: bool = False
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    instantiable: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"model config: {name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model config: num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(f"model config: hidden_size ({self.hidden_size}) must be divisible by "
                             f"num_heads ({self.num_heads}) when head_dim is not given")
        if self.head_size % 2:
            raise ValueError(f"model config: head_dim must be even for RoPE, got {self.head_size}")

    @property
    def has_qkv_bias(self) -> bool:
        return self.attention_bias or self.qkv_bias

    @property
    def head_size(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    def num_params(self) -> int:
        """Parameter count (embeddings and lm_head included), computed from the shape alone."""
        d, hd = self.hidden_size, self.head_size
        attn = d * hd * (self.num_heads * 2 + self.num_kv_heads * 2)
        mlp = 3 * d * self.intermediate_size
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + mlp + 2 * d) + embed + d

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_size * dtype_bytes

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], name: str) -> ModelConfig:
        """Build from a Hugging Face `config.json` dict; ValueError names what is wrong."""
        model_type = raw.get("model_type")
        if model_type not in _SUPPORTED_MODEL_TYPES:
            raise ValueError(f"config.json: model_type {model_type!r} is not supported; "
                             f"use a Llama-family model ({', '.join(_SUPPORTED_MODEL_TYPES)})")
        try:
            num_heads = int(raw["num_attention_heads"])
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            max_pos = int(raw.get("max_position_embeddings", 2048))
            window = raw.get("sliding_window")
            if model_type == "qwen2" and not raw.get("use_sliding_window", False):
                window = None
            if window is not None and int(window) < max_pos:  # never beyond the window: exact
                max_pos = int(window)
            # transformers >= 5 writes RoPE settings as `rope_parameters` (theta inside)
            rope = raw.get("rope_parameters") or {}
            rope_theta = raw.get("rope_theta", rope.get("rope_theta", 10000.0))
            return cls(
                name=name,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=int(raw["hidden_size"]),
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
                max_position_embeddings=max_pos,
                head_dim=int(raw["head_dim"]) if raw.get("head_dim") else None,
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
                rope_theta=float(rope_theta),
                rope_scaling=_parse_rope_scaling(raw.get("rope_scaling") or rope or None),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bool(raw.get("attention_bias", False)),
                qkv_bias=model_type == "qwen2",
                mlp_bias=bool(raw.get("mlp_bias", False)),
                model_type=str(model_type),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        except KeyError as exc:
            raise ValueError(f"config.json: missing required field {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise ValueError(f"config.json: malformed value ({exc})") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """A `config.json` that transformers' LlamaForCausalLM loads to the same model."""
        out: dict[str, Any] = {
            "architectures": [_ARCHITECTURES[self.model_type]], "model_type": self.model_type,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_size, "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings, "attention_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias, "hidden_act": "silu", "torch_dtype": "float32",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if self.eos_token_ids else None,
        }
        if self.rope_scaling is not None:
            rs = self.rope_scaling
            out["rope_scaling"] = {
                "rope_type": "llama3", "factor": rs.factor, "low_freq_factor": rs.low_freq_factor,
                "high_freq_factor": rs.high_freq_factor,
                "original_max_position_embeddings": rs.original_max_position_embeddings,
            }
        return out


def _parse_rope_scaling(raw: Any) -> RopeScaling | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"config.json: rope_scaling must be an object, got {raw!r}")
    kind = raw.get("rope_type", raw.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ValueError(f"config.json: rope_scaling type {kind!r} is not supported "
                         "(supported: llama3, default)")
    return RopeScaling(
        factor=float(raw["factor"]),
        low_freq_factor=float(raw["low_freq_factor"]),
        high_freq_factor=float(raw["high_freq_factor"]),
        original_max_position_embeddings=int(raw["original_max_position_embeddings"]),
    )


# Byte-level tokenizer ids for presets: 0..255 are bytes, then BOS and EOS (see tokenizer.py).
BYTE_BOS_ID = 256
BYTE_EOS_ID = 257

_LLAMA3_ROPE = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                           original_max_position_embeddings=8192)

PRESETS: dict[str, ModelConfig] = {
    # For tests: 4 layers, d=128, GQA 4:2, small enough to run in milliseconds.
    "tiny": ModelConfig(name="tiny", vocab_size=512, hidden_size=128, intermediate_size=384,
                        num_layers=4, num_heads=4, num_kv_heads=2, max_position_embeddings=2048,
                        bos_token_id=BYTE_BOS_ID, eos_token_ids=(BYTE_EOS_ID,)),
    # ~110M parameters: the benchmark model.
    "small": ModelConfig(name="small", vocab_size=32000, hidden_size=768,
                         intermediate_size=2048, num_layers=12, num_heads=12, num_kv_heads=4,
                         max_position_embeddings=8192, rope_theta=500000.0,
                         tie_word_embeddings=True,
                         bos_token_id=BYTE_BOS_ID, eos_token_ids=(BYTE_EOS_ID,)),
    # Shapes only, for cost models; never instantiated here.
    "llama3-8b": ModelConfig(name="llama3-8b", vocab_size=128256, hidden_size=4096,
                             intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                             max_position_embeddings=131072, rope_theta=500000.0,
                             rope_scaling=_LLAMA3_ROPE, bos_token_id=128000,
                             eos_token_ids=(128001, 128009), instantiable=False),
    "llama3-70b": ModelConfig(name="llama3-70b", vocab_size=128256, hidden_size=8192,
                              intermediate_size=28672, num_layers=80, num_heads=64,
                              num_kv_heads=8, max_position_embeddings=131072,
                              rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE,
                              bos_token_id=128000, eos_token_ids=(128001, 128009),
                              instantiable=False),
}


LINEAR_MODES = ("auto", "aten", "aten_t", "onednn", "mkl_gemv", "mkl_split")
ATTENTION_MODES = ("auto", "kernel", "gather")


@dataclass(frozen=True)
class EngineConfig:
    """Settings of one engine instance. CLI defaults are read from here."""

    block_size: int = 16
    kv_cache_bytes: int = 256 * 2**20  # the paged KV pool; num_blocks = this // bytes per block
    num_blocks: int | None = None  # overrides kv_cache_bytes when given
    max_num_batched_tokens: int = 2048  # token budget of one step (chunked prefill beyond it)
    max_num_seqs: int = 64
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    dtype: str = "float32"
    device: str = "auto"  # "auto": cuda when present, else cpu
    seed: int = 0  # seeds dummy weights of presets
    enable_prefix_caching: bool = True
    # CPU fp32 GEMM backend of the linear layers: "auto" measures per shape at start-up
    # (kvcake/engine/linear.py), or one of aten | aten_t | onednn | mkl_gemv | mkl_split forced.
    linear_backend: str = "auto"
    # Decode attention: "auto" = the paged-attention op when it builds (else "gather"),
    # "kernel" = the op or an error, "gather" = copy each context out of the pool, then SDPA.
    attention: str = "auto"
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.extra:
            raise ValueError(f"engine config: unknown keys {sorted(self.extra)}")
        for name in ("block_size", "kv_cache_bytes", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"engine config: {name} must be >= 1, got {getattr(self, name)}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"engine config: num_blocks must be >= 1, got {self.num_blocks}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"engine config: max_model_len must be >= 2, got {self.max_model_len}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"engine config: dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.linear_backend not in LINEAR_MODES:
            raise ValueError(f"engine config: linear_backend must be one of {LINEAR_MODES}, "
                             f"got {self.linear_backend!r}")
        if self.attention not in ATTENTION_MODES:
            raise ValueError(f"engine config: attention must be one of {ATTENTION_MODES}, "
                             f"got {self.attention!r}")
        if self.device != "auto" and not self.device.startswith(("cpu", "cuda")):
            raise ValueError(f"engine config: device must be auto, cpu or cuda[:N], "
                             f"got {self.device!r}")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> EngineConfig:
        known = {f.name for f in fields(cls)} - {"extra"}
        unknown = {k: v for k, v in raw.items() if k not in known}
        return cls(**{k: v for k, v in raw.items() if k in known}, extra=unknown)
