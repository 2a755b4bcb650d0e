"""Which CPUs each launched worker process runs on (`ClusterConfig.pin_workers`, on by
default). Pure policy.

The rule: when the CPUs this launcher may use hold a CPU for every thread of every launched
worker (each worker's `num_threads`), each worker gets its own disjoint CPUs, in the config's
worker order over the CPUs in ascending order; otherwise nobody is pinned (pinning on too few
CPUs would only fix which workers share one). The launcher's own process (the HTTP frontend,
the Conductor, the store master) stays unpinned and runs where the scheduler finds room.

Why it exists: a decode worker's step is its TBT; a worker that the scheduler moves between
cores, or that shares a core with another engine for a while, pays cold caches and waits. One
core per engine thread is what a worker's `num_threads` asks for, and it applies to every role
alike, so a colocated baseline's workers get the same treatment as a disaggregated pair's.
Why it is on by default: on the 2-core machine, 1P+1D unpinned at 0.787 req/s, separate
invocations of the same replay had the decode worker's busiest thread on the prefill worker's
CPU in 0-25% of samples, and their TBT p50 ranged 29-58 ms with it; pinned, 24.7-29.4 ms
(docs/benchmarks.md, eleventh session: between-invocation variation). An earlier A/B at 1.113
req/s found no gain within one run's noise (issue 11 part 2). Its cost: a pinned worker cannot
leave a core that another process (the frontend, another tenant) occupies, which the scheduler
otherwise does for it; `pin_workers = false` for a host whose cores other tenants share.
"""

from __future__ import annotations

from collections.abc import Sequence


def plan_cpus(threads: Sequence[int | None], cpus: Sequence[int]) -> list[tuple[int, ...]] | None:
    """CPUs per worker (same order as `threads`), or None when not every worker can have its
    own: a worker with `None` threads (torch's default, every core) or more threads in all than
    `cpus` holds."""
    if any(n is not None and n < 1 for n in threads):
        raise ValueError(f"pin_workers: a worker's num_threads must be >= 1, got {list(threads)}")
    if not threads or any(n is None for n in threads):
        return None
    free = sorted(set(cpus))
    if sum(n for n in threads if n is not None) > len(free):
        return None
    plan: list[tuple[int, ...]] = []
    for n in threads:
        assert n is not None
        plan.append(tuple(free[:n]))
        free = free[n:]
    return plan
