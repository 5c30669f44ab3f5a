"""The scheduler's waiting queue: users take turns, priorities come first, a preempted
request goes back to the front (engine/scheduling/waiting_queue.py)."""

from __future__ import annotations

import pytest

from engine.scheduling.request import Request
from engine.scheduling.waiting_queue import WaitingQueue
from protocol import SamplingParams, Scheduling


def _request(name: str, user: str = "", priority: int = 0) -> Request:
    return Request(b"server", name, [1, 2, 3], SamplingParams(), 0, Scheduling(priority, user))


def _drain(queue: WaitingQueue) -> list[str]:
    order = []
    while queue:
        assert queue.peek() is not None
        order.append(queue.pop().request_id)
    return order


def test_users_take_turns_and_each_users_requests_keep_their_order() -> None:
    queue = WaitingQueue("fcfs")
    for index in range(4):  # one request with n=4, or one client sending four
        queue.push(_request(f"big-{index}", user="big"))
    queue.push(_request("small-0", user="small"))
    queue.push(_request("other-0", user="other"))
    assert len(queue) == 6
    assert _drain(queue) == ["big-0", "small-0", "other-0", "big-1", "big-2", "big-3"]


def test_priority_first_then_turns() -> None:
    queue = WaitingQueue("priority")
    queue.push(_request("late-a", user="a", priority=5))
    queue.push(_request("urgent-b", user="b", priority=-1))
    queue.push(_request("normal-a", user="a"))
    queue.push(_request("normal-a2", user="a"))
    queue.push(_request("normal-c", user="c"))
    assert [r.request_id for r in queue] == [
        "urgent-b",
        "normal-a",
        "normal-a2",
        "normal-c",
        "late-a",
    ]
    assert _drain(queue) == ["urgent-b", "normal-a", "normal-c", "normal-a2", "late-a"]


def test_a_preempted_request_goes_first_again() -> None:
    queue = WaitingQueue("fcfs")
    queue.push(_request("a-0", user="a"))
    queue.push(_request("b-0", user="b"))
    queue.push_front(_request("b-preempted", user="b"))
    assert _drain(queue) == ["b-preempted", "a-0", "b-0"]


def test_remove_forgets_an_emptied_user() -> None:
    queue = WaitingQueue("priority")
    aborted = _request("aborted", user="a", priority=3)
    queue.push(aborted)
    queue.push(_request("kept", user="b"))
    queue.remove(aborted)
    assert len(queue) == 1
    assert _drain(queue) == ["kept"]


def test_running_requests_keep_priority_order_under_the_priority_policy() -> None:
    running: list[Request] = []
    queue = WaitingQueue("priority")
    for name, priority in (("p1", 1), ("p0", 0), ("p2", 2), ("p0-later", 0)):
        queue.add_running(running, _request(name, priority=priority))
    # Preemption takes from the end: the least urgent, then the newest.
    assert [r.request_id for r in running] == ["p0", "p0-later", "p1", "p2"]
    fcfs_running: list[Request] = []
    fcfs = WaitingQueue("fcfs")
    for name in ("first", "second"):
        fcfs.add_running(fcfs_running, _request(name, priority=0))
    assert [r.request_id for r in fcfs_running] == ["first", "second"]


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="scheduling policy"):
        WaitingQueue("lifo")
