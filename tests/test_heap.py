"""runs/heap.py: work held until a silo's reply has left (run at once where no reply is being
sent, else when the sender's block ends, in order, failures logged and not raised), and freed
memory given back once a deployed silo has had no message for a while."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time

import pytest

from dpcfl_flwr.runs import heap
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


#: A process that frees 128 MiB of 64-KiB blocks between live ones (glibc keeps such holes for
#: reuse; only a trim returns their pages), then goes through three sequences of messages
#: and prints its resident memory (MiB) after each: the trim may come only after the last.
_HOLES_THEN_MESSAGES = r"""
import json, re, sys, time
from dpcfl_flwr.runs import heap

def rss():
    status = open("/proc/self/status").read()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024

kept, freed = [], []
for _ in range(2048):
    freed.append(bytearray(64 << 10))
    kept.append(bytearray(64 << 10))
del freed
seen = {"holes": rss()}
heap.IDLE_SECONDS = 0.3
heap.message_started(); heap.message_started()
heap.message_answered()  # the other message is still being answered: no trim
time.sleep(0.8)
seen["one of two answered"] = rss()
heap.message_answered()
heap.message_started()  # a new message within the wait calls the trim off
time.sleep(0.8)
seen["called off by a new message"] = rss()
heap.message_answered()
armed = time.monotonic()
while rss() > seen["holes"] - 96 and time.monotonic() < armed + 30:
    time.sleep(0.02)
seen["idle"] = rss()
seen["seconds to the trim"] = time.monotonic() - armed
print(json.dumps(seen))
"""


def test_freed_memory_goes_back_only_once_no_message_has_come_for_the_idle_wait():
    done = subprocess.run([sys.executable, "-c", _HOLES_THEN_MESSAGES], capture_output=True,
                          text=True, timeout=120, check=True)
    seen = json.loads(done.stdout)
    holes = seen["holes"]
    assert seen["one of two answered"] > holes - 32, seen
    assert seen["called off by a new message"] > holes - 32, seen
    assert seen["idle"] <= holes - 96, seen  # most of the 128 MiB of holes went back
    assert seen["seconds to the trim"] >= 0.3 - 0.01, seen


def test_a_deployed_silo_trims_once_after_its_last_message_not_after_each(
        tmp_path, monkeypatch, server_task_identity):
    from tests.test_malicious_server import Attacker

    trims: list[float] = []
    monkeypatch.setattr(heap, "IDLE_SECONDS", 2.0)
    monkeypatch.setattr(heap, "give_back_freed_memory", lambda: trims.append(time.monotonic()))
    attacker = Attacker(tmp_path)
    assert not attacker.query().has_error()
    answered = time.monotonic()
    assert not attacker.query().has_error()  # calls off the trim the first reply armed
    last = time.monotonic()
    assert last - answered < heap.IDLE_SECONDS, "the machine stalled between two queries"
    while not trims and time.monotonic() < last + 30:
        time.sleep(0.05)
    time.sleep(0.5)
    assert len(trims) == 1 and trims[0] >= last + heap.IDLE_SECONDS - 0.25, trims
