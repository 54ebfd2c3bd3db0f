"""vmsandbox.qemu_user: the range QEMU uids come from, the choice of a free one, the DAC label."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vmsandbox.errors import InvalidArgument
from vmsandbox.qemu_user import DEFAULT_QEMU_UIDS, MIN_FIRST, UidRange, dac_label, parse_uid_range, pick_uid


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("2000000000-2000065535", UidRange(2_000_000_000, 65536)),
        ("65536-65536", UidRange(65536, 1)),
        (" 100000-100009 ", UidRange(100_000, 10)),
    ],
)
def test_ranges(text: str, want: UidRange) -> None:
    assert parse_uid_range(text) == want


@pytest.mark.parametrize(
    "text",
    ["", "1000-2000", "0-65535", "65534-70000", "70000-69999", "70000", "a-b", "70000-4294967295", "-1-5"],
)
def test_ranges_refused(text: str) -> None:
    with pytest.raises(InvalidArgument, match="qemu_uids"):
        parse_uid_range(text)


def test_the_default_range_is_above_system_and_login_users() -> None:
    assert DEFAULT_QEMU_UIDS.first >= MIN_FIRST and str(DEFAULT_QEMU_UIDS) == "2000000000-2000065535"


@pytest.mark.parametrize(
    ("used", "want"),
    [(set(), 100), ({100}, 101), ({100, 102}, 101), ({0, 5}, 100), ({100, 101, 102}, None)],
)
def test_pick_uid(used: set[int], want: int | None) -> None:
    assert pick_uid(UidRange(100, 3), used) == want


@given(st.sets(st.integers(min_value=90, max_value=120)))
def test_a_picked_uid_is_in_range_and_free(used: set[int]) -> None:
    uids = UidRange(100, 10)
    uid = pick_uid(uids, used)
    free = set(range(100, 110)) - used
    assert (uid is None) == (not free)
    assert uid is None or (uid in free and uid == min(free))


def test_dac_label_is_numeric() -> None:
    assert dac_label(2_000_000_001) == "+2000000001:+2000000001"


def test_the_config_key() -> None:
    from shim.config import ShimConfig, config_from_mapping

    assert ShimConfig().qemu_uids == DEFAULT_QEMU_UIDS
    assert config_from_mapping({"qemu_uids": "300000-300099"}, "c.yaml").qemu_uids == UidRange(300_000, 100)
    with pytest.raises(InvalidArgument, match=r"c\.yaml: qemu_uids"):
        config_from_mapping({"qemu_uids": "0-99"}, "c.yaml")
