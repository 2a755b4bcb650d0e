"""`kvcake profile` and `kvcake worker` from the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcake.cli import main
from kvcake.server.cluster.profiler import Profile, cache_path


def test_profile_measures_fits_and_caches(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["profile", "--cache-dir", str(tmp_path), "--input-lens", "16,48,96",
            "--kv-cache-bytes", "8MiB"]  # batch 8 x 256 fits whole
    assert main(argv) == 0
    out = capsys.readouterr().out
    path = cache_path(tmp_path, "tiny", "float32", 1)
    assert f"profile of tiny (float32, 1 threads): {path}" in out
    profile = Profile.from_json(path.read_text())
    # 3 input lengths x 3 prefix shares, and 3 batch sizes x 2 contexts of decode steps.
    assert [(p.input_len, p.prefix_len) for p in profile.prefill_points] == [
        (16, 0), (16, 0), (16, 0), (48, 0), (48, 16), (48, 32), (96, 0), (96, 48), (96, 80)]
    assert [(d.batch_size, d.context_tokens) for d in profile.decode_points] == [
        (1, 32), (1, 256), (4, 128), (4, 1024), (8, 256), (8, 2048)]
    assert all(p.time_s > 0 for p in profile.prefill_points)
    raw = json.loads(path.read_text())
    raw["prefill_points"][0][2] = 123.0  # a cached file is reused, not measured again
    path.write_text(json.dumps(raw))
    assert main(argv) == 0
    assert Profile.from_json(path.read_text()).prefill_points[0].time_s == 123.0


@pytest.mark.parametrize(("argv", "error"), [
    (["worker", "--role", "mixer"], "role: must be one of prefill, decode, colocated"),
    (["worker", "--store-dram-bytes", "lots"], "--store-dram-bytes: cannot read 'lots'"),
    (["profile", "--input-lens", "1,x"], "--input-lens: expected at least 3 comma-separated integers >= 2"),
    (["profile", "--input-lens", "1,2"], "--input-lens: expected at least 3"),
    (["profile", "--num-threads", "0"], "num_threads: must be >= 1"),
])
def test_bad_arguments_exit_2_with_one_line(argv: list[str], error: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert error in capsys.readouterr().err
