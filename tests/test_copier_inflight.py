"""``Copier._make_room``: before a new copy is issued at most ``ahead - 1`` copies (and
``max_inflight - n`` bytes) stay in flight (``Config.copy_ahead``, 1 by default: the copy
stream runs dry before every issue, so the program's own small copies never queue behind a
second piece).

Unit tests with fakes: a copier built around a stand-in window and arena, and copy events
that complete only when waited for (``synchronize``), so the test sees exactly which
copies ``_make_room`` waited for. No device, no threads.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


from gpusnap.capture.copier import Copier

PIECE = 1 << 20
CHUNK = 1 << 16


class FakeEvent:
    """A copy still running until someone waits for it (or ``done`` is given)."""

    def __init__(self, name: str, log: list[str], *, done: bool = False) -> None:
        self.name, self.log, self.done = name, log, done

    def synchronize(self) -> None:
        self.log.append(self.name)
        self.done = True

    def query(self) -> bool:
        return self.done


def _copier(ahead: int) -> tuple[Copier, list[Any]]:
    handed: list[Any] = []
    window = SimpleNamespace(trace=None)
    arena = SimpleNamespace(max_region=lambda: 64 * PIECE, release=lambda region: None)
    copier = Copier(window, arena, lambda pieces: handed.extend(pieces),  # type: ignore[arg-type]
                    chunk_size=CHUNK, piece_bytes=PIECE, ahead=ahead, consistent_events={}, streams={})
    return copier, handed


def _in_flight(copier: Copier, log: list[str], sizes: list[int], done: tuple[int, ...] = ()) -> list[FakeEvent]:
    events = []
    for i, n in enumerate(sizes):
        event = FakeEvent(f"copy{i}", log, done=i in done)
        copier._issued([(f"span{i}", 0, n, 0)], f"region{i}", n, event)  # type: ignore[list-item, arg-type]
        events.append(event)
    return events


def _left(copier: Copier) -> list[str]:
    return [entry[0].name for entry in copier._inflight]


def test_the_default_is_one_copy_in_flight() -> None:
    from gpusnap import Config

    assert Config().copy_ahead == 1


def test_with_ahead_1_the_copy_in_flight_is_waited_for_before_the_next_issue() -> None:
    copier, handed = _copier(ahead=1)
    log: list[str] = []
    _in_flight(copier, log, [PIECE])
    copier._make_room(PIECE)
    assert log == ["copy0"] and _left(copier) == [] and copier._inflight_bytes == 0
    assert [region for _segments, region in handed] == ["region0"]


def test_with_ahead_1_even_a_small_copy_is_waited_for() -> None:
    copier, handed = _copier(ahead=1)
    log: list[str] = []
    _in_flight(copier, log, [CHUNK])  # its bytes would leave room: the count does not
    copier._make_room(CHUNK)
    assert log == ["copy0"] and _left(copier) == []
    assert len(handed) == 1


def test_with_ahead_2_one_copy_may_stay_in_flight() -> None:
    copier, handed = _copier(ahead=2)
    log: list[str] = []
    _in_flight(copier, log, [PIECE])
    copier._make_room(PIECE)
    assert log == [] and _left(copier) == ["copy0"]  # one ahead: not waited for
    assert handed == []


def test_with_ahead_2_and_two_in_flight_only_the_oldest_is_waited_for() -> None:
    copier, _handed = _copier(ahead=2)
    log: list[str] = []
    _in_flight(copier, log, [PIECE // 4, PIECE // 4])  # the bytes leave room: only the count binds
    copier._make_room(PIECE // 4)
    assert log == ["copy0"] and _left(copier) == ["copy1"]


def test_with_ahead_4_at_most_three_small_copies_stay_in_flight() -> None:
    copier, _handed = _copier(ahead=4)
    log: list[str] = []
    _in_flight(copier, log, [CHUNK] * 4)
    copier._make_room(CHUNK)
    assert log == ["copy0"] and _left(copier) == ["copy1", "copy2", "copy3"]


def test_copies_already_complete_are_taken_without_waiting() -> None:
    copier, handed = _copier(ahead=3)
    log: list[str] = []
    _in_flight(copier, log, [PIECE // 4, PIECE // 4], done=(0, 1))
    copier._make_room(PIECE // 4)  # room in count and bytes: nothing to wait for
    assert log == [] and _left(copier) == []  # both handed over, found done
    assert [region for _s, region in handed] == ["region0", "region1"]


def test_the_byte_bound_still_holds_with_room_in_the_count() -> None:
    copier, _handed = _copier(ahead=4)  # at most 4 pieces' bytes
    log: list[str] = []
    _in_flight(copier, log, [PIECE, PIECE, PIECE])
    copier._make_room(PIECE)  # 3 + 1 pieces' bytes fit: nothing waited for
    assert log == [] and len(_left(copier)) == 3
    copier._make_room(2 * PIECE)  # 3 + 2 do not: the oldest goes
    assert log == ["copy0"] and _left(copier) == ["copy1", "copy2"]


def test_after_make_room_fewer_than_ahead_copies_are_in_flight() -> None:
    for ahead in (1, 2, 3, 5):
        copier, _handed = _copier(ahead=ahead)
        log: list[str] = []
        _in_flight(copier, log, [CHUNK] * ahead)
        copier._make_room(CHUNK)
        assert len(copier._inflight) < ahead, ahead
        assert log[0] == "copy0", ahead  # the oldest first
