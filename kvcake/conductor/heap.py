"""Keep the cyclic garbage collector off the Conductor's long-lived state (an explicit call).

A serving process (the live frontend) or a long simulation holds a large, long-lived heap: the
Conductor's index, the per-instance books, a loaded trace, the model's tokenizer. CPython's
full collections rescan all of it, tens of milliseconds on a million-entry view, and that pause
lands on whichever decision happens to allocate at that moment. `freeze_heap()` moves what is
alive now into the permanent generation, which collections skip (`gc.freeze`, Python >= 3.7).

Contract: call it once after the long-lived state is loaded and before serving; it is cheap to
call again after a large reload. Frozen objects are never collected, even once unreferenced
(`gc.unfreeze()` undoes it): do not call it per request. Nothing else in the Conductor depends
on it: decisions are the same with or without.
"""

from __future__ import annotations

import gc


def freeze_heap() -> int:
    """Collect garbage, then freeze every object alive; returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
