"""The status over time: a bounded history, and the change events ``GET /v1/vram/events`` streams.

Plain bookkeeping (no clock reads: time is an argument; no HTTP). The daemon hands the feed its
status (``Daemon.status()``, the one schema) whenever something may have changed and on a
period; the feed

* keeps a **history**: one sample per ``interval_s``, the last ``history_s`` seconds of them, in a
  ring (a page opened later draws the recent past from it);
* makes an **event** of each status that differs from the last one, numbered from 1, and puts it
  in every subscriber's queue. A queue holds at most ``pending_limit`` events: when a reader lags
  that far behind, a new event replaces the newest one still waiting (a state the reader would
  have passed at once). So events may be coalesced but are never reordered, a queue never grows
  without bound, and the last event a reader gets is always the latest state.

Statuses travel as their JSON text, made once per change: a status that did not change is the
same string object again, so a quiet history costs a reference per sample.

:func:`event_stream` is the Server-Sent Events stream of one reader (asyncio, no HTTP): the
history, the current status, each change, a heartbeat comment when nothing changed for
``heartbeat_s``, and its end when the feed closes (the daemon stops).
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from strata.daemon.bounded import Bounded

if TYPE_CHECKING:
    from strata.daemon.status import StatusJson

HISTORY_S = 600.0  # ten minutes of history ...
INTERVAL_S = 1.0  # ... at one sample a second
PENDING_LIMIT = 8  # events waiting for one reader before new ones coalesce
HEARTBEAT_S = 5.0  # a comment line when nothing changed for this long


@dataclass(frozen=True)
class StatusEvent:
    """One status change: ``id`` counts the changes from 1; ``data`` is the status as JSON."""

    id: int
    data: str


class Subscription:
    """One reader's events not yet taken, in order. ``wake`` is called when one arrives or the
    subscription ends (the stream waits on it)."""

    def __init__(self, limit: int, wake: Callable[[], None] = lambda: None) -> None:
        if limit < 1:
            raise ValueError(f"a subscription's limit of {limit} events: must be at least 1")
        self.limit = limit
        self.wake = wake
        self.closed = False
        self.coalesced = 0  # events replaced by a newer one before the reader took them
        self._pending: deque[StatusEvent] = deque()

    def put(self, event: StatusEvent) -> None:
        if self.closed:
            return
        if len(self._pending) >= self.limit:
            self._pending.pop()  # the newest waiting one: the new event supersedes it
            self.coalesced += 1
        self._pending.append(event)
        self.wake()

    def take(self) -> list[StatusEvent]:
        """Every event waiting, oldest first; the queue is empty afterwards."""
        events = list(self._pending)
        self._pending.clear()
        return events

    @property
    def pending(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        """No more events after those waiting; the reader ends once it has taken them."""
        self.closed = True
        self.wake()


class StatusFeed:
    def __init__(
        self,
        history_s: float = HISTORY_S,
        interval_s: float = INTERVAL_S,
        pending_limit: int = PENDING_LIMIT,
    ) -> None:
        if interval_s <= 0 or history_s < interval_s:
            raise ValueError(
                f"a status history of {history_s} s at one sample per {interval_s} s: the "
                "interval must be > 0 and the history at least one interval"
            )
        self.interval_s = interval_s
        self.pending_limit = pending_limit
        self.closed = False
        self._samples: deque[tuple[float, str]] = deque(maxlen=int(history_s / interval_s))
        self._last: StatusEvent | None = None
        self._next_sample_at: float | None = None
        self._subs: set[Subscription] = set()

    # -- the producer ---------------------------------------------------------------------------

    def update(self, now: float, status: StatusJson) -> StatusEvent | None:
        """Take the status at ``now`` (Unix seconds): an event when it differs from the last one
        (returned, and queued for every subscriber), a history sample when one is due."""
        if self.closed:
            return None
        text = json.dumps(status, ensure_ascii=False, separators=(",", ":"))
        event = None
        if self._last is None or text != self._last.data:
            event = StatusEvent(self._last.id + 1 if self._last else 1, text)
            self._last = event
            for sub in list(self._subs):
                sub.put(event)
        if self._next_sample_at is None or now >= self._next_sample_at:
            self._samples.append((now, self._last.data))  # the one string for equal statuses
            self._next_sample_at = now + self.interval_s
        return event

    def close(self, now: float, status: StatusJson) -> None:
        """The daemon stops: the final status goes out, then every stream ends."""
        self.update(now, status)
        self.closed = True
        for sub in list(self._subs):
            sub.close()

    # -- the readers ----------------------------------------------------------------------------

    @property
    def last(self) -> StatusEvent | None:
        """The latest status (None before the first update)."""
        return self._last

    def subscribe(self, wake: Callable[[], None] = lambda: None) -> Subscription:
        """A new reader's queue, receiving every change after ``last``; already closed when the
        feed is."""
        sub = Subscription(self.pending_limit, wake)
        if self.closed:
            sub.close()
        else:
            self._subs.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        self._subs.discard(sub)

    def history(self, now: float) -> str:
        """The history as the JSON text of the ``history`` event (docs/http.md)."""
        samples = ",".join(
            f'{{"at_us":{round(at * 1e6)},"status":{text}}}' for at, text in self._samples
        )
        return (
            f'{{"now_us":{round(now * 1e6)},"interval_s":{self.interval_s:g},'
            f'"samples":[{samples}]}}'
        )

    def sizes(self, max_subscribers: int) -> list[Bounded]:
        """What the feed holds, for ``/metrics``: readers are requests in progress, so at most
        ``max_subscribers`` of them."""
        return [
            Bounded("status_streams", "readers of /v1/vram/events", len(self._subs),
                    max_subscribers),
            Bounded("status_events_pending", "status events waiting for their readers",
                    sum(s.pending for s in self._subs), max_subscribers * self.pending_limit),
            Bounded("status_history_samples", "status samples kept for the history",
                    len(self._samples), self._samples.maxlen),
        ]  # fmt: skip


# -- Server-Sent Events -------------------------------------------------------------------------


def sse_event(name: str, data: str, id: int | None = None) -> bytes:
    """One event; ``data`` is JSON text on one line (``json.dumps`` escapes newlines)."""
    head = f"id: {id}\n" if id is not None else ""
    return f"{head}event: {name}\ndata: {data}\n\n".encode()


HEARTBEAT = b": heartbeat\n\n"


async def event_stream(
    feed: StatusFeed, now: Callable[[], float], heartbeat_s: float = HEARTBEAT_S
) -> AsyncIterator[bytes]:
    """One reader's stream: ``history`` (no id), the current ``status``, then each change; a
    heartbeat comment after ``heartbeat_s`` without one; the end once the feed closes."""
    woken = asyncio.Event()
    sub = feed.subscribe(woken.set)
    try:
        current = feed.last  # later changes queue up in ``sub`` meanwhile
        yield sse_event("history", feed.history(now()))
        if current is not None:
            yield sse_event("status", current.data, current.id)
        while True:
            for event in sub.take():
                yield sse_event("status", event.data, event.id)
            if sub.closed:
                return
            woken.clear()  # no await since take(): no event can have slipped in between
            try:
                await asyncio.wait_for(woken.wait(), heartbeat_s)
            except TimeoutError:
                yield HEARTBEAT
    finally:
        feed.unsubscribe(sub)
