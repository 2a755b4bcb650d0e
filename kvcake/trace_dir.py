"""The directory a diagnostic trace writes its JSON lines into, named by an environment variable
(`$KVCAKE_STEP_TRACE`: kvcake/engine/step_trace.py; `$KVCAKE_PLACEMENT_TRACE`:
kvcake/server/cluster/placement_trace.py): unset, no trace; set to a path that is not a
directory, a ValueError that says what to do."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TextIO

__all__ = ["open_trace"]


def open_trace(env: str, file_name: str) -> TextIO | None:
    """`$env/file_name` opened to append, line-buffered (so each line is whole on disk once
    written); None when `env` is unset or empty."""
    directory = os.environ.get(env)
    if not directory:
        return None
    path = Path(directory)
    if not path.is_dir():
        raise ValueError(f"${env}={directory!r}: not a directory; create it or unset {env}")
    return (path / file_name).open("a", buffering=1)
