"""What building an engine (or a CPP stage) takes from its configuration: the device and dtype,
the loaded model, its linear layers' tuned backends, the decode attention mode, the longest
sequence it serves and the namespace of its block keys. Shared by `Engine` and `StageEngine`."""

from __future__ import annotations

import torch

from kvcake.engine import cpu_ops
from kvcake.engine.config import EngineConfig, ModelConfig
from kvcake.engine.linear import Choice, Linear, table_path, tune
from kvcake.engine.loader import ModelSource, load_weights
from kvcake.engine.model import LlamaModel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} requested but CUDA is not available; use cpu")
    return torch.device(device)


def max_model_len_of(model_config: ModelConfig, config: EngineConfig) -> int:
    """The longest sequence an engine serves: its setting, capped at the model's positions."""
    return min(config.max_model_len or model_config.max_position_embeddings,
               model_config.max_position_embeddings)


def load_model(model: str, source: ModelSource, config: EngineConfig,
               layers: range | None = None) -> LlamaModel:
    """The model (or its `layers` slice) with its weights; ValueError naming what is wrong when
    a weight is missing or the weights and config.json disagree."""
    llama = LlamaModel(source.config, layers)
    try:
        llama.load_hf_state_dict(load_weights(source, config.seed))
    except KeyError as exc:
        raise ValueError(f"model: weight {exc.args[0]!r} is missing from {model!r}") from None
    except (RuntimeError, ValueError) as exc:  # weights and config.json disagree
        raise ValueError("model: " + " ".join(str(exc).split())) from None
    return llama


def kv_namespace(model_config: ModelConfig, config: EngineConfig, *,
                 from_directory: bool) -> str:
    """The namespace of this engine's block keys (`hashing.block_keys`): the model, its
    weights, the KV dtype and the block size. Engines (and the layer stages of one CPP group)
    share cached KV exactly when their namespaces are equal."""
    weights = "hf" if from_directory else f"seed{config.seed}"
    return f"kvcake/{model_config.name}/{weights}/{config.dtype}/b{config.block_size}"


def tune_linears(model: torch.nn.Module, backend: str) -> list[Choice]:
    """Every `Linear` of `model` on its fastest backend (`linear.tune`), remembered per thread
    count in the CPU ops' cache directory."""
    return tune([m for m in model.modules() if isinstance(m, Linear)], backend,
                table=table_path(cpu_ops.cache_dir(), torch.get_num_threads()))


def attention_mode(mode: str, device: torch.device) -> str:
    """"kernel" (paged-attention op) or "gather", from the config's `attention` and what loads."""
    if mode == "gather" or device.type != "cpu":
        return "gather"
    if cpu_ops.load():
        return "kernel"
    if mode == "kernel":
        raise ValueError(f"attention: the paged-attention op could not be built "
                         f"({cpu_ops.load_error()}); use attention 'auto' or "
                         f"'gather', or install a C++ compiler")
    return "gather"
