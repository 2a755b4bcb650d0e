"""kvcake: MOONCAKE's KVCache-centric disaggregated serving, in Python.

`from kvcake import LLM, SamplingParams` loads the engine (and torch) lazily, so that policy
code (the Conductor, the simulator) imports without torch.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from kvcake.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kvcake.engine.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'kvcake' has no attribute {name!r}")
