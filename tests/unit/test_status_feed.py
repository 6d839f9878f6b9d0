"""The status feed without a daemon: the bounded history, change events, coalescing queues that
never reorder, and the Server-Sent Events stream of one reader."""

from __future__ import annotations

import asyncio
import json

import pytest

from strata.daemon.status_feed import (
    HEARTBEAT,
    StatusFeed,
    Subscription,
    event_stream,
    sse_event,
)


def status(reserve: int, **more: object) -> dict[str, object]:
    return {"state": "ready", "reserve_mib": reserve, "leases": [], **more}


def test_an_event_only_when_the_status_changes_numbered_from_one() -> None:
    feed = StatusFeed()
    first = feed.update(0.0, status(0))
    assert first is not None and first.id == 1 and json.loads(first.data) == status(0)
    assert feed.update(0.5, status(0)) is None  # the same status: no event
    second = feed.update(0.7, status(100))
    assert second is not None and second.id == 2
    assert feed.last == second


def test_history_keeps_one_sample_per_interval_and_only_the_last_ones() -> None:
    feed = StatusFeed(history_s=10, interval_s=1)
    for tick in range(60):  # 30 s at two updates a second, the reserve changing every second
        feed.update(tick * 0.5, status(tick // 2))
    history = json.loads(feed.history(30.0))
    assert history["interval_s"] == 1 and history["now_us"] == 30_000_000
    samples = history["samples"]
    assert len(samples) == 10  # bounded: the ring holds ten minutes' worth (here ten seconds)
    assert [s["at_us"] for s in samples] == [t * 1_000_000 for t in range(20, 30)]
    assert [s["status"]["reserve_mib"] for s in samples] == list(range(20, 30))
    sizes = {b.name: b for b in feed.sizes(4)}
    assert sizes["status_history_samples"].size == 10 == sizes["status_history_samples"].limit


def test_a_quiet_history_shares_one_string() -> None:
    feed = StatusFeed(history_s=100, interval_s=1)
    for t in range(50):
        feed.update(float(t), status(7))
    texts = {id(text) for _, text in feed._samples}
    assert len(feed._samples) == 50 and len(texts) == 1


def test_a_lagging_reader_gets_coalesced_events_in_order_ending_with_the_latest() -> None:
    feed = StatusFeed(pending_limit=4)
    woken: list[int] = []
    sub = feed.subscribe(lambda: woken.append(1))
    for i in range(1, 101):
        feed.update(float(i), status(i))
    events = sub.take()
    assert len(events) == 4  # never more than the limit waiting
    ids = [e.id for e in events]
    assert ids == sorted(ids) and len(set(ids)) == 4  # never reordered
    assert json.loads(events[-1].data)["reserve_mib"] == 100  # the final state is last
    assert [json.loads(e.data)["reserve_mib"] for e in events[:3]] == [1, 2, 3]
    assert sub.coalesced == 96 and len(woken) == 100
    assert sub.take() == []


def test_a_reader_that_keeps_up_sees_every_change() -> None:
    feed = StatusFeed(pending_limit=2)
    sub = feed.subscribe()
    seen = []
    for i in range(50):
        feed.update(float(i), status(i))
        seen += [json.loads(e.data)["reserve_mib"] for e in sub.take()]
    assert seen == list(range(50))


def test_close_sends_the_final_status_and_ends_every_subscription() -> None:
    feed = StatusFeed()
    feed.update(0.0, status(0))
    sub = feed.subscribe()
    feed.close(1.0, status(0, state="stopping"))
    events = sub.take()
    assert [json.loads(e.data)["state"] for e in events] == ["stopping"]
    assert sub.closed
    assert feed.update(2.0, status(5)) is None  # nothing after the close
    late = feed.subscribe()
    assert late.closed


def test_unsubscribed_readers_are_forgotten_and_counted_while_they_last() -> None:
    feed = StatusFeed(pending_limit=3)
    subs = [feed.subscribe() for _ in range(3)]
    feed.update(0.0, status(1))
    sizes = {b.name: b for b in feed.sizes(8)}
    assert sizes["status_streams"].size == 3 and sizes["status_streams"].limit == 8
    assert sizes["status_events_pending"].size == 3 and sizes["status_events_pending"].limit == 24
    for sub in subs:
        feed.unsubscribe(sub)
    assert {b.name: b.size for b in feed.sizes(8)}["status_streams"] == 0


def test_bad_sizes_are_errors_naming_them() -> None:
    with pytest.raises(ValueError, match="interval"):
        StatusFeed(history_s=10, interval_s=0)
    with pytest.raises(ValueError, match="limit of 0"):
        Subscription(0)


def test_sse_event_format() -> None:
    assert sse_event("status", '{"a":1}', 7) == b'id: 7\nevent: status\ndata: {"a":1}\n\n'
    assert sse_event("history", "{}") == b"event: history\ndata: {}\n\n"


def parse(raw: bytes) -> list[dict[str, str]]:
    """SSE messages as dicts of their fields; a comment is {"comment": text}."""
    out = []
    for block in raw.decode().split("\n\n"):
        if not block:
            continue
        fields: dict[str, str] = {}
        for line in block.split("\n"):
            name, _, value = line.partition(": ")
            fields["comment" if name == "" else name] = value
        out.append(fields)
    return out


def test_the_stream_sends_history_current_changes_heartbeats_and_ends_on_close() -> None:
    async def scenario() -> list[bytes]:
        feed = StatusFeed()
        feed.update(0.0, status(0))
        chunks: list[bytes] = []
        stream = event_stream(feed, lambda: 1.0, heartbeat_s=0.01)
        chunks.append(await anext(stream))  # history
        chunks.append(await anext(stream))  # the current status
        chunks.append(await anext(stream))  # nothing changed: a heartbeat
        for i in range(1, 21):
            feed.update(float(i), status(i))
        feed.close(30.0, status(20, state="stopping"))
        chunks += [chunk async for chunk in stream]  # ends by itself once the feed closed
        assert feed.sizes(1)[0].size == 0  # the reader is gone
        return chunks

    chunks = asyncio.run(scenario())
    assert chunks[2] == HEARTBEAT
    events = parse(b"".join(chunks))
    assert events[0]["event"] == "history" and "id" not in events[0]
    assert json.loads(events[0]["data"])["samples"][0]["status"]["reserve_mib"] == 0
    statuses = [e for e in events if e.get("event") == "status"]
    ids = [int(e["id"]) for e in statuses]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    last = json.loads(statuses[-1]["data"])
    assert last["state"] == "stopping" and last["reserve_mib"] == 20


def test_a_reader_that_leaves_is_unsubscribed() -> None:
    async def scenario() -> int:
        feed = StatusFeed()
        feed.update(0.0, status(0))
        stream = event_stream(feed, lambda: 1.0, heartbeat_s=60)
        await anext(stream)
        await stream.aclose()  # the client went away
        return {b.name: b.size for b in feed.sizes(1)}["status_streams"] or 0

    assert asyncio.run(scenario()) == 0
