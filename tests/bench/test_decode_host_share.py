"""benchmarks/decode_host_share.py: perf's report parsed, each shared object counted for the
right class, shares exact; bad flags refused by name. No perf run here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import decode_host_share as dhs  # noqa: E402

REPORT = """\
    44.60%  446  [JIT] tid 4514
    24.00%  240  kvcake_ops-977e05240eb61b31.so
    16.50%  165  libtorch_cpu.so
     6.40%   64  libpython3.11.so.1.0
     2.80%   28  libc.so.6
     2.30%   23  libgomp.so.1
     2.20%   22  libtorch_python.so
     0.70%    7  libc10.so
     0.30%    3  [kernel.kallsyms]
     0.20%    2  libstdc++.so.6.0.30

"""


def test_the_report_is_parsed_and_every_object_counted_for_its_class() -> None:
    samples = dhs.parse_report("# a header line\n#\n" + REPORT)
    assert samples["[JIT] tid 4514"] == 446 and samples["libtorch_python.so"] == 22
    assert sum(samples.values()) == 1000
    assert dhs.shares(samples) == pytest.approx(
        {"python": 0.064, "bindings": 0.022, "ops": 0.446 + 0.24 + 0.165 + 0.023 + 0.007,
         "other": 0.028 + 0.003 + 0.002})


@pytest.mark.parametrize(("dso", "cls"), [
    ("libpython3.11.so.1.0", "python"), ("python3.11", "python"), ("/usr/bin/python3", "python"),
    ("libtorch_python.so", "bindings"), ("libtorch_cpu.so", "ops"), ("libgomp.so.1", "ops"),
    ("libiomp5.so", "ops"), ("libmkl_core.so", "ops"), ("libdnnl.so.3", "ops"),
    ("kvcake_ops-0123.so", "ops"), ("[JIT] tid 77", "ops"), ("libc.so.6", "other"),
    ("[kernel.kallsyms]", "other"), ("[unknown]", "other"), ("python_helper.so", "other")])
def test_each_shared_object_has_one_class(dso: str, cls: str) -> None:
    assert dhs.classify(dso) == cls


def test_no_samples_give_zero_shares() -> None:
    assert dhs.shares({}) == dict.fromkeys(dhs.CLASSES, 0.0)


@pytest.mark.parametrize(("argv", "says"), [
    (["--batches", "0,8"], "positive integers"), (["--batches", "a"], "--batches"),
    (["--steps", "0"], "--steps must be >= 1"), (["--rounds", "0"], "--rounds must be >= 1")])
def test_bad_flags_are_refused_by_name(argv: list[str], says: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        dhs.main(argv)
    assert exc.value.code == 2 and says in capsys.readouterr().err
