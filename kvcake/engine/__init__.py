"""One engine instance: a Llama-family model on a paged KV pool with prefix caching and
continuous batching. `Engine` (engine.py) is the worker-facing API; `LLM` (llm.py) the offline
one. block_manager.py, batcher.py and sequence.py are pure policy; the rest is mechanism."""
