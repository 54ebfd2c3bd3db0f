"""Which host user each sandbox's QEMU runs as: one uid (and the gid of the same number) per
sandbox, from a range the admin configures (``qemu_uids``), none of them a system or login user.

Pure: parsing the range, choosing a free uid, and the DAC label libvirt runs QEMU with.
"""

from __future__ import annotations

from dataclasses import dataclass

from vmsandbox.errors import InvalidArgument

MIN_FIRST = 65536
"""The lowest uid a range may start at: below it lie system and login users (and ``nobody``)."""
MAX_LAST = (1 << 32) - 2  # (uid_t)-1 means "no change" to chown


@dataclass(frozen=True)
class UidRange:
    first: int
    count: int

    @property
    def last(self) -> int:
        return self.first + self.count - 1

    def __str__(self) -> str:
        return f"{self.first}-{self.last}"


DEFAULT_QEMU_UIDS = UidRange(first=2_000_000_000, count=65536)


def parse_uid_range(text: str, where: str = "qemu_uids") -> UidRange:
    """``FIRST-LAST`` (inclusive), FIRST at least MIN_FIRST."""
    first_text, sep, last_text = str(text).strip().partition("-")
    if not sep or not first_text.isdigit() or not last_text.isdigit():
        raise InvalidArgument(f"{where}: must be FIRST-LAST (two uids), got {str(text)[:64]!r}")
    first, last = int(first_text), int(last_text)
    if first < MIN_FIRST or last > MAX_LAST or last < first:
        raise InvalidArgument(
            f"{where}: {first}-{last} must lie within {MIN_FIRST}-{MAX_LAST} (above system and login users) "
            "and not be empty"
        )
    return UidRange(first, last - first + 1)


def pick_uid(uids: UidRange, used: set[int]) -> int | None:
    """The lowest uid of ``uids`` no sandbox has (``used``); None when every one is taken."""
    if sum(1 for u in used if uids.first <= u <= uids.last) >= uids.count:
        return None
    return next((uid for uid in range(uids.first, uids.last + 1) if uid not in used), None)


def dac_label(uid: int) -> str:
    """libvirt's DAC label for QEMU as ``uid`` with the group of the same number (``+`` : numbers)."""
    return f"+{uid}:+{uid}"
