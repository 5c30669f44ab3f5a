"""The scheduler's queue of waiting requests: which one is admitted next (--scheduling-policy).

``fcfs``: the requests of one user in the order they came. ``priority``: vLLM's, the lowest
priority value first, and within a priority as ``fcfs``; running requests are kept in the
same order, so that a preemption takes the one that would have been admitted last.

Within a priority, users take turns (``Scheduling.user``: the OpenAI request's ``user``, else
its client's address): the next request admitted is the oldest of the user whose turn it is,
then that user goes to the back of the turns. One user's many requests (a request with a
large n, or a client sending thousands) so wait behind one another, not in front of everyone
else's. A preempted request goes back to the front, of its user's requests and of the turns.

Each operation costs one dict and one deque operation (``remove``: a scan of one user's
requests), whatever the queue's length: the scheduler calls them per request admitted, never
per token.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict, deque
from collections.abc import Iterator

from engine.scheduling.request import Request

SCHEDULING_POLICIES = ("fcfs", "priority")


class _Turns:
    """One priority's waiting requests: each user's in order, the users in turn."""

    def __init__(self) -> None:
        self.by_user: OrderedDict[str, deque[Request]] = OrderedDict()

    def push(self, request: Request) -> None:
        user = request.scheduling.user
        queue = self.by_user.get(user)
        if queue is None:
            self.by_user[user] = deque([request])
        else:
            queue.append(request)

    def push_front(self, request: Request) -> None:
        user = request.scheduling.user
        self.by_user.setdefault(user, deque()).appendleft(request)
        self.by_user.move_to_end(user, last=False)

    def peek(self) -> Request:
        return next(iter(self.by_user.values()))[0]

    def pop(self) -> Request:
        user, queue = next(iter(self.by_user.items()))
        request = queue.popleft()
        if queue:
            self.by_user.move_to_end(user)  # the next user's turn
        else:
            del self.by_user[user]
        return request

    def remove(self, request: Request) -> None:
        user = request.scheduling.user
        queue = self.by_user[user]
        queue.remove(request)
        if not queue:
            del self.by_user[user]


class WaitingQueue:
    """The waiting requests in the order ``policy`` admits them (module docstring)."""

    def __init__(self, policy: str = "fcfs") -> None:
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy must be one of {SCHEDULING_POLICIES}")
        self.by_priority = policy == "priority"
        self._levels: dict[int, _Turns] = {}
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __iter__(self) -> Iterator[Request]:
        for priority in sorted(self._levels):
            for queue in self._levels[priority].by_user.values():
                yield from queue

    def push(self, request: Request) -> None:
        """A new request, after every request waiting now in its user's turn."""
        self._level(request).push(request)
        self._size += 1

    def push_front(self, request: Request) -> None:
        """A preempted request: admitted again before any other of its priority."""
        self._level(request).push_front(request)
        self._size += 1

    def peek(self) -> Request:
        """The request admitted next (the queue must not be empty)."""
        return self._levels[min(self._levels)].peek()

    def pop(self) -> Request:
        """Takes out the request admitted next."""
        priority = min(self._levels)
        turns = self._levels[priority]
        request = turns.pop()
        if not turns.by_user:
            del self._levels[priority]
        self._size -= 1
        return request

    def remove(self, request: Request) -> None:
        priority = request.scheduling.priority
        turns = self._levels[priority]
        turns.remove(request)
        if not turns.by_user:
            del self._levels[priority]
        self._size -= 1

    def add_running(self, running: list[Request], request: Request) -> None:
        """Puts an admitted request into ``running``, which the scheduler keeps oldest first,
        preempting from the end: with priorities, in (priority, arrival) order."""
        if self.by_priority:
            bisect.insort(running, request, key=_priority_order)
        else:
            running.append(request)

    def _level(self, request: Request) -> _Turns:
        priority = request.scheduling.priority
        turns = self._levels.get(priority)
        if turns is None:
            turns = self._levels[priority] = _Turns()
        return turns


def _priority_order(request: Request) -> tuple[int, float]:
    return request.scheduling.priority, request.arrival_time
