"""The server's commands: `kvcake serve` (`serve.py`), `kvcake worker` and `kvcake profile`
(`worker.py`)."""
