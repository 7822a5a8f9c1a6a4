"""A message pulled by a silo whose session then ended gets an error reply at the ServerApp's
next request (dpcfl_flwr/flower_compat/ended_sessions.py), on Flower's own link states (in
memory and SQL) driven through Flower's in-memory grid, as the ServerApp drives them.

The deployment test (tests/test_deployment.py) shows the same on real processes: a silo
killed while it trains, restarted at once, and the round going on without it.
"""

from __future__ import annotations

import pytest
from flwr.app import MetricRecord, RecordDict
from flwr.common.constant import ErrorCode
from flwr.proto.task_pb2 import Task  # pylint: disable=E0611
from flwr.server.superlink.linkstate import LinkStateFactory
from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState, RunRecord
from flwr.server.superlink.linkstate.sql_linkstate import SqlLinkState
from flwr.supercore.constant import NOOP_FEDERATION_ID, TaskType
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supercore.run import Run
from flwr.superlink.federation import NoOpFederationManager
from flwr.superlink.grid.inmemory_grid import InMemoryGrid

from dpcfl_flwr.flower_compat.ended_sessions import (
    SESSION_ENDED,
    EndedSessions,
    answer_ended_sessions,
    unanswered_in_memory,
    unanswered_in_sql,
)

HEARTBEAT = 30.0  # seconds


def _memory_state(cls, tmp_path, objects):
    state = cls(NoOpFederationManager(), objects)
    run = Run.create_empty(7)
    run.primary_task_id, run.federation_id = 70, NOOP_FEDERATION_ID
    state.run_ids[7] = RunRecord(run=run)
    state.task_store[70] = Task(task_id=70, run_id=7)
    return state, run


def _sql_state(cls, tmp_path, objects):
    state = cls(str(tmp_path / "state.db"), NoOpFederationManager(), objects)
    state.initialize()
    run_id = state.create_run(None, None, None, {}, NOOP_FEDERATION_ID, None, None,
                              TaskType.SERVER_APP)
    return state, state.get_run_info(run_ids=[run_id])[0]


KINDS = {"memory": (InMemoryLinkState, _memory_state, unanswered_in_memory),
         "sql": (SqlLinkState, _sql_state, unanswered_in_sql)}


@pytest.fixture(params=sorted(KINDS))
def link(request, tmp_path, task_identity):
    """A link state of each kind (a subclass of Flower's, patched: Flower's own classes stay
    as they are), two activated nodes, and a grid on the state's run."""
    base, make, unanswered = KINDS[request.param]
    patched = type(f"Patched{base.__name__}", (base,), {})
    ended = EndedSessions()
    answer_ended_sessions(patched, ended, unanswered)
    factory = LinkStateFactory(":flwr-in-memory:", NoOpFederationManager(),
                               ObjectStoreFactory())
    state, run = make(patched, tmp_path, factory.objectstore_factory.store())
    factory.state_instance = state
    task_identity(run.primary_task_id, run.run_id, 1)  # the ServerApp's (SuperLink: node 1)
    nodes = [state.create_node("aid", "silo", bytes([i + 1]) * 32, HEARTBEAT) for i in range(3)]
    assert all(state.activate_node(node, HEARTBEAT) for node in nodes)
    grid = InMemoryGrid(state_factory=factory)
    grid.set_run(run)
    return state, grid, nodes, ended


def _send(grid, nodes):
    messages = [grid.create_message(RecordDict({"m": MetricRecord({"x": 1.0})}), "train", node,
                                    "round-1") for node in nodes]
    return list(grid.push_messages(messages))


def test_a_message_held_by_a_session_that_ended_gets_an_error_reply(link):
    state, grid, nodes, ended = link
    ids = _send(grid, nodes)
    for node, message_id in zip(nodes[:2], ids, strict=False):  # nodes 0, 1 pull; 2 does not
        assert [m.metadata.message_id for m in state.get_message_ins(node, None)] == [message_id]
    assert list(grid.pull_messages(ids)) == []  # all three online, no reply yet
    # Node 0 is killed and comes back at once: its restarted SuperNode ends the old session
    # and is activated again before the ServerApp asks (what dpcfl client does).
    assert state.deactivate_node(nodes[0]) and state.activate_node(nodes[0], HEARTBEAT)
    # Node 2 restarts the same way, but had pulled nothing: its message is still to deliver.
    assert state.deactivate_node(nodes[2]) and state.activate_node(nodes[2], HEARTBEAT)
    assert len(ended) == 1
    replies = list(grid.pull_messages(ids))
    assert [r.metadata.reply_to_message_id for r in replies] == [ids[0]]
    (reply,) = replies
    assert reply.has_error() and reply.error.code == ErrorCode.NODE_UNAVAILABLE
    assert reply.error.reason == SESSION_ENDED
    assert reply.metadata.run_id == grid.run.run_id
    assert list(grid.pull_messages(ids[1:])) == []  # the others still wait for their silos
    # Node 2's new session pulls its message as usual.
    assert [m.metadata.message_id for m in state.get_message_ins(nodes[2], None)] == [ids[2]]


def test_a_message_answered_before_the_restart_is_not_failed(link):
    state, grid, nodes, ended = link
    ids = _send(grid, nodes[:1])
    (instruction,) = state.get_message_ins(nodes[0], None)
    reply = instruction.create_reply(RecordDict({"m": MetricRecord({"y": 2.0})}))
    reply.metadata.__dict__["_message_id"] = reply.object_id
    assert state.store_message_res(reply) is not None
    assert state.deactivate_node(nodes[0]) and state.activate_node(nodes[0], HEARTBEAT)
    assert len(ended) == 0
    (got,) = grid.pull_messages(ids)
    assert not got.has_error() and got.content["m"]["y"] == 2.0


def test_expired_messages_are_forgotten(link):
    state, grid, nodes, ended = link
    ids = _send(grid, nodes[:1])
    (instruction,) = state.get_message_ins(nodes[0], None)
    assert state.deactivate_node(nodes[0]) and state.activate_node(nodes[0], HEARTBEAT)
    assert len(ended) == 1
    expiry = instruction.metadata.created_at + instruction.metadata.ttl
    ended.note([], now=expiry - 1)
    assert len(ended) == 1
    ended.note([], now=expiry + 1)  # the ServerApp stopped waiting: nothing kept for it
    assert len(ended) == 0 and list(grid.pull_messages(ids)) == []
