"""Work held until a silo's reply has left (runs/heap.py): run at once where no reply is
being sent, else when the sender's block ends, in order, failures logged and not raised."""

from __future__ import annotations

import logging

import pytest

from dpcfl_flwr.runs.heap import after_reply, reply_first


def test_held_work_runs_in_order_when_the_reply_has_left_and_a_failure_stops_nothing(caplog):
    done: list[str] = []

    def failing() -> None:
        raise OSError("no heap to trim")

    after_reply(lambda: done.append("no reply being sent: at once"))
    with caplog.at_level(logging.ERROR, logger="dpcfl_flwr.runs.heap"), \
            pytest.raises(RuntimeError, match="the handler failed"), reply_first():
        after_reply(lambda: done.append("first"))
        after_reply(failing)
        after_reply(lambda: done.append("after the failure"))
        done.append("reply sent")
        raise RuntimeError("the handler failed")
    assert done == ["no reply being sent: at once", "reply sent", "first", "after the failure"]
    assert [r.message for r in caplog.records] == ["clean-up after a reply failed"]
    after_reply(lambda: done.append("outside again: at once"))
    assert done[-1] == "outside again: at once"
