"""Activity: requests in flight on a Memory, and when background work may run between them."""

from __future__ import annotations

import threading

import pytest

from kvmem.activity import Activity


def test_nothing_is_counted_until_someone_watches() -> None:
    activity = Activity()
    with activity:
        assert activity.in_flight == 0  # no prefetcher listens: a request pays one attribute read
        activity.watch()
        with activity:
            assert activity.in_flight == 1
    assert activity.in_flight == 0  # the request that began unwatched ended without taking a count


def test_nested_and_failing_requests_are_counted_while_they_run() -> None:
    activity = Activity()
    activity.watch()
    with activity:
        with activity:
            assert activity.in_flight == 2
        with pytest.raises(ValueError), activity:
            raise ValueError("a request that fails")
        assert activity.in_flight == 1
    assert activity.in_flight == 0


def test_no_room_while_a_request_is_in_flight_and_room_once_it_ends() -> None:
    activity = Activity()
    activity.watch()
    assert activity.wait_for_room(0.001, timeout=0.0)  # nothing ever ran: room
    started, release = threading.Event(), threading.Event()

    def request() -> None:
        with activity:
            started.set()
            release.wait()

    thread = threading.Thread(target=request)
    thread.start()
    started.wait()
    assert not activity.wait_for_room(0.0, timeout=0.0)  # in flight: no room, and no waiting past the timeout
    release.set()
    assert activity.wait_for_room(0.0, timeout=60.0)  # woken as it ends
    thread.join()
