"""TransferConfig validation: bad values name the field; unknown keys are errors."""

from __future__ import annotations

import pytest

from kvcake.transfer import TransferConfig
from kvcake.transfer.checksum import ChecksumKind, available, parse


@pytest.mark.parametrize(("values", "field"), [
    ({"slice_bytes": 0}, "slice_bytes"),
    ({"slice_bytes": 100}, "slice_bytes"),
    ({"num_rails": 0}, "num_rails"),
    ({"pipeline_depth": 0}, "pipeline_depth"),
    ({"max_retries": -1}, "max_retries"),
    ({"num_rails": 2, "rail_bind_hosts": ("127.0.0.1",)}, "rail_bind_hosts"),
    ({"port": 70000}, "port"),
    ({"io_timeout_s": 0}, "io_timeout_s"),
    ({"checksum": "md5"}, "checksum"),
    ({"socket_buffer_bytes": -1}, "socket_buffer_bytes"),
])
def test_bad_values_name_the_field(values: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=f"TransferConfig.{field}"):
        TransferConfig(**values)  # type: ignore[arg-type]


def test_from_dict_rejects_unknown_keys_and_converts_lists() -> None:
    with pytest.raises(ValueError, match=r"unknown transfer config keys \['rails'\]"):
        TransferConfig.from_dict({"rails": 4})
    config = TransferConfig.from_dict({"num_rails": 2, "rail_bind_hosts": ["127.0.0.1"] * 2})
    assert config.rail_bind_hosts == ("127.0.0.1", "127.0.0.1")


def test_checksum_names() -> None:
    assert parse("crc32") is ChecksumKind.CRC32
    assert parse("auto") is available()[-1]
    assert ChecksumKind.CRC32.compute(b"hello") == 0x3610A686


def test_defaults_leave_digests_off_and_socket_buffers_to_the_kernel() -> None:
    config = TransferConfig()
    assert (config.checksum_tcp, config.checksum_shm, config.socket_buffer_bytes) == (False, False, 0)


def test_which_slices_carry_a_digest() -> None:
    default, checked = TransferConfig(), TransferConfig(checksum_tcp=True, checksum_shm=True)
    assert [default.digests(True), default.digests(True, True), default.digests(True, False)] \
        == [False, True, False]
    assert [checked.digests(True), checked.digests(True, False)] == [True, False]
    # a request's override is for TCP only: shared memory follows checksum_shm
    assert [default.digests(False, True), checked.digests(False, False)] == [False, True]
