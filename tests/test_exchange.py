"""The round's message exchange: every reply collected, few polls while silos are busy."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from flwr.app import Message, MetricRecord, RecordDict
from flwr.superlink.grid.inmemory_grid import InMemoryGrid

from dpcfl_flwr.strategies import exchange as exchange_module
from dpcfl_flwr.strategies.exchange import (
    BACKOFF,
    MAX_POLL_SECONDS,
    POLL_SECONDS,
    exchange,
    longest_poll,
    next_poll_delay,
)

from .grid_double import GridDouble


class SlowGrid(GridDouble):
    """Replies become visible ``after[node]`` seconds after the push; pulls are counted."""

    def __init__(self, after: dict[int, float]) -> None:
        super().__init__({node: self._answer for node in after})
        self.after = after
        self.visible_at: dict[str, float] = {}
        self.pulls = self.pushes = 0
        self.held = 0.0  # seconds an empty pull waits, as a holding SuperLink's does
        # ("pull", replies it brought) and ("wait", seconds the exchange asked for), in order
        self.events: list[tuple[str, float]] = []

    @staticmethod
    def _answer(message: Message) -> Message:
        return Message(RecordDict({"m": MetricRecord({"ok": 1})}), reply_to=message)

    def push_messages(self, messages):
        self.pushes += 1
        ids = list(super().push_messages(messages))
        for i, message in zip(ids, self.sent[-len(ids):], strict=True):
            self.visible_at[i] = time.monotonic() + self.after[message.metadata.dst_node_id]
        return ids

    def pull_messages(self, message_ids):
        self.pulls += 1
        now = time.monotonic()
        ready = [i for i in message_ids if self.visible_at.get(i, float("inf")) <= now]
        if not ready and self.held:  # wait for the first reply, at most ``held`` s
            first = min((self.visible_at.get(i, float("inf")) for i in message_ids),
                        default=float("inf"))
            time.sleep(max(0.0, min(first, now + self.held) - now))
            now = time.monotonic()
            ready = [i for i in message_ids if self.visible_at.get(i, float("inf")) <= now]
        self.events.append(("pull", len(ready)))
        return super().pull_messages(ready)

    def waits_after(self, brought: Callable[[float], bool]) -> list[float]:
        """The waits the exchange asked for right after a pull whose count of replies
        satisfies ``brought``."""
        return [then[1] for now, then in zip(self.events, self.events[1:], strict=False)
                if now[0] == "pull" and brought(now[1]) and then[0] == "wait"]


@pytest.fixture(autouse=True)
def recorded_waits(monkeypatch):
    """The exchange's waits between polls are slept as asked and noted in the grid's events.
    The tests check those asked-for waits, not wall time: a busy machine makes every pull and
    sleep take longer, which only shortens the waits the exchange asks for next."""
    def wait(grid, seconds: float) -> None:
        if isinstance(grid, SlowGrid):
            grid.events.append(("wait", seconds))
        time.sleep(seconds)

    monkeypatch.setattr(exchange_module, "wait_for_replies", wait)


def _messages(nodes):
    return {node: Message(RecordDict(), dst_node_id=node, message_type="train")
            for node in nodes}


def test_delay_backs_off_while_nothing_arrives_and_resets_on_a_reply():
    delay, waits = POLL_SECONDS / BACKOFF, []
    for _ in range(10):
        delay = next_poll_delay(delay, got_reply=False)
        waits.append(delay)
    assert waits[0] == pytest.approx(POLL_SECONDS)
    assert all(b >= a for a, b in zip(waits, waits[1:], strict=False))
    assert waits[-1] == MAX_POLL_SECONDS
    assert next_poll_delay(MAX_POLL_SECONDS, got_reply=True) == POLL_SECONDS
    assert next_poll_delay(POLL_SECONDS, got_reply=False, ceiling=POLL_SECONDS) == POLL_SECONDS


def test_only_a_remote_grid_is_polled_less_often():
    # Flower's simulation engine serves the ServerApp an InMemoryGrid (no state needed here).
    assert longest_poll(InMemoryGrid.__new__(InMemoryGrid)) == POLL_SECONDS
    assert longest_poll(SlowGrid({})) == MAX_POLL_SECONDS


@pytest.mark.usefixtures("server_task_identity")
def test_a_silent_second_costs_a_handful_of_polls_and_trickling_replies_arrive_fast():
    # One silo is slow (1.2 s); the others reply 0.1 s apart later, as silos finish.
    after = {1: 1.2, 2: 1.9, 3: 2.0, 4: 2.1}
    grid = SlowGrid(after)
    result = exchange(grid, _messages(after), timeout=10.0)
    assert sorted(result.replies) == [1, 2, 3, 4] and not result.missing
    # Polling every 50 ms would take ~42 pulls; backing off takes under half of that.
    assert grid.pulls <= 17
    # While nothing arrives the waits grow to at most the ceiling; after a pull that brought
    # a reply the next one comes within 50 ms, so trickling replies are not left waiting.
    assert max(grid.waits_after(lambda n: n == 0)) <= MAX_POLL_SECONDS
    assert grid.waits_after(lambda n: n > 0)
    assert max(grid.waits_after(lambda n: n > 0)) <= POLL_SECONDS


@pytest.mark.usefixtures("server_task_identity")
def test_replies_that_never_come_are_missing_after_the_timeout():
    grid = SlowGrid({1: 0.0, 2: 60.0})
    result = exchange(grid, _messages([1, 2]), timeout=0.8)
    assert list(result.replies) == [1] and result.missing == [2]
    # no wait reaches past the timeout (the last is cut at it)
    assert sum(seconds for kind, seconds in grid.events if kind == "wait") <= 0.8


@pytest.mark.usefixtures("server_task_identity")
def test_a_round_goes_out_in_one_push_and_a_refused_message_is_missing():
    class Refusing(SlowGrid):
        def push_messages(self, messages):  # Flower's in-memory grid drops refused ones
            messages = list(messages)
            ids = list(super().push_messages(messages))
            return [i for i, m in zip(ids, messages, strict=True)
                    if m.metadata.dst_node_id != 2]

    grid = Refusing({1: 0.0, 2: 0.0, 3: 0.0})
    result = exchange(grid, _messages([1, 2, 3]), timeout=2.0)
    assert grid.pushes == 1
    assert sorted(result.replies) == [1, 3] and result.missing == [2]


@pytest.mark.usefixtures("server_task_identity")
def test_a_poll_the_link_held_is_not_followed_by_a_wait():
    # The link holds an empty pull up to 0.3 s until a reply is ready. Polling again at once
    # after a held pull keeps the exchange listening: the reply at 2.5 s is collected then.
    # Waiting the backed-off delay (0.25-0.5 s by then) after each held pull would leave it
    # deaf for a third of the time (here: the reply collected at ~2.84 s).
    grid = SlowGrid({1: 2.5})
    grid.held = 0.3
    result = exchange(grid, _messages([1]), timeout=5.0)
    assert list(result.replies) == [1]
    # each wait counts from its poll's start, so the 0.3 s held comes off it
    assert max(grid.waits_after(lambda n: n == 0)) <= MAX_POLL_SECONDS - grid.held + 1e-9
