"""`block_runs`: one transfer request per run of blocks consecutive at both ends."""

from kvcake.server.worker.kv_runs import block_runs


def test_runs_break_where_either_side_jumps() -> None:
    src = [4, 5, 6, 9, 10, 11, 12]
    dst = [0, 1, 2, 3, 4, 8, 9]
    assert block_runs(src, dst, 0, 7) == [(4, 0, 3), (9, 3, 2), (11, 8, 2)]


def test_window_and_cached_targets() -> None:
    src = [0, 1, 2, 3, 4, 5]
    dst = [-1, -1, 7, 8, 9, 10]
    assert block_runs(src, dst, 0, 6) == [(2, 7, 4)]
    assert block_runs(src, dst, 3, 5) == [(3, 8, 2)]
    assert block_runs(src, dst, 4, 99) == [(4, 9, 2)]  # capped at the lists
    assert block_runs(src, [-1] * 6, 0, 6) == []
