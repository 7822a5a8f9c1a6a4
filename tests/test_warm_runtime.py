"""The silo's ClientApp runtime runs a task only if its FAB ships the app installed on the silo
(dpcfl_flwr/app_pin.py): warm in its process, or one flwr-clientapp per message; any
other FAB is answered with an Error and none of its code runs. tests/test_app_pinning.py does
the same against real SuperNodes over gRPC."""

from __future__ import annotations

import io
import threading
import time
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Context, Message, RecordDict
from flwr.cli.build import build_fab_from_disk
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode, SubStatus
from flwr.proto.runtime_pb2 import AcquireTaskRequest  # pylint: disable=E0611
from flwr.proto.task_pb2 import Task  # pylint: disable=E0611
from flwr.supercore.constant import TaskType
from flwr.supercore.fab import Fab
from flwr.supercore.inflatable.inflatable_object import (
    get_all_nested_objects,
    get_object_tree,
)
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supercore.run import Run
from flwr.supernode.nodestate import NodeStateFactory

import dpcfl_flwr
from dpcfl_flwr import app_pin
from dpcfl_flwr.config.settings import parse_node_config
from dpcfl_flwr.deploy.silo_file import SiloFile, supernode_command
from dpcfl_flwr.flower_compat import warm_runtime
from dpcfl_flwr.flower_compat.direct_runtime import (
    REMEMBERED_VERDICTS,
    DirectRuntimeClient,
    direct_link,
    fab_check,
)
from dpcfl_flwr.flower_compat.warm_runtime import WarmRuntime
from dpcfl_flwr.runs.heap import after_reply

PACKAGE = Path(dpcfl_flwr.__file__).parent
FAB_ID, FAB_VERSION = "dpcfl/dpcfl-flwr", "0.1.0"


@pytest.fixture(scope="module")
def fab() -> bytes:
    """The FAB ``flwr run .`` sends, built by Flower from this checkout."""
    return build_fab_from_disk(PACKAGE.parent)


def _rewritten(fab: bytes, change) -> bytes:
    """``fab`` with ``change(name, data)`` -> data (None drops the file) applied to each file."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(fab)) as source, zipfile.ZipFile(out, "w") as target:
        for name in source.namelist():
            data = change(name, source.read(name))
            if data is not None:
                target.writestr(name, data)
    return out.getvalue()


def _added(fab: bytes, name: str, data: bytes) -> bytes:
    out = io.BytesIO(fab)
    with zipfile.ZipFile(out, "a") as archive:
        archive.writestr(name, data)
    return out.getvalue()


def _edited(name: str, edit):
    return lambda file, data: edit(data) if file == name else data


def test_the_fab_built_from_the_installed_package_is_accepted(fab):
    assert app_pin.refusal(fab) is None
    assert app_pin.refusal(fab, FAB_ID, FAB_VERSION) is None


@pytest.mark.parametrize(("tamper", "reason"), [
    (lambda fab: _rewritten(fab, _edited("dpcfl_flwr/client_app.py",
                                         lambda data: data + b"\n# skip the ledger\n")),
     "its dpcfl_flwr/client_app.py differs from the installed one"),
    (lambda fab: _rewritten(fab, lambda name, data: None if name.endswith("ledger.py")
                            else data), "it lacks dpcfl_flwr/privacy/ledger.py"),
    (lambda fab: _added(fab, "dpcfl_flwr/extra.py", b"x = 1\n"),
     "it ships dpcfl_flwr/extra.py, which is not a module of the installed package"),
    # a compiled module next to its source would be imported instead of it
    (lambda fab: _added(fab, "dpcfl_flwr/silo.cpython-311-x86_64-linux-gnu.so", b"\x7fELF"),
     "it ships dpcfl_flwr/silo.cpython-311"),
    # a top-level package would shadow the real one on the app's sys.path
    (lambda fab: _added(fab, "torch/__init__.py", b"import os\n"), "it ships torch/__init__.py"),
    (lambda fab: _added(fab, "README.md", b"hello\n"), "it ships README.md"),
    (lambda fab: _added(fab, "./dpcfl_flwr/silo/silo.py", b"x = 1\n"), "non-canonical name"),
    (lambda fab: _added(fab, "dpcfl_flwr/silo/silo.py", b"x = 1\n"),
     "ships dpcfl_flwr/silo/silo.py twice"),
    (lambda fab: _rewritten(fab, _edited("pyproject.toml", lambda data: data.replace(
        b'clientapp = "dpcfl_flwr.client_app:app"', b'clientapp = "dpcfl_flwr.silo.silo:app"'))),
     "its ClientApp is 'dpcfl_flwr.silo.silo:app'"),
    (lambda fab: _rewritten(fab, _edited("pyproject.toml", lambda data: b"not toml = [")),
     "its pyproject.toml is not a Flower app's"),
    (lambda fab: b"not a zip", "not a readable FAB"),
])
def test_a_fab_with_other_code_is_refused_with_one_line_saying_why(fab, tamper, reason):
    refused = app_pin.refusal(tamper(fab))
    assert refused is not None and reason in refused and "\n" not in refused


def test_a_run_that_names_another_app_is_refused(fab):
    # flwr-clientapp loads the app installed under the run's name, not the FAB's
    refused = app_pin.refusal(fab, "other/app", FAB_VERSION)
    assert refused is not None and "the run names app other/app 0.1.0" in refused


class Recorded(WarmRuntime):
    """The runtime with Flower's task I/O replaced: what it pulls, runs, pushes and starts."""

    def __init__(self, fab: bytes, check_fab=None, per_message: bool = False) -> None:
        super().__init__("127.0.0.1:1", app=self.app_called, check_fab=check_fab,
                         per_message=per_message, connect=lambda token: _NoClient())
        self.fab = fab
        self.answered: list[str] = []  # "app" or "fresh process"
        self.pushed: list[Message] = []
        self.statuses: list[tuple[str, str]] = []

    def app_called(self, message: Message, context: Context) -> Message:
        self.answered.append("app")
        return Message(RecordDict(), reply_to=message)

    def _run_fresh_process(self, token: str) -> None:
        self.answered.append("fresh process")


class _NoClient:
    def close(self) -> None:
        pass


@pytest.fixture
def task_io(monkeypatch, task_identity):
    """Flower's task I/O in the runtime, replaced by the runtime's own records (Recorded)."""
    task_identity(1, 1, 5)
    runtimes: list[Recorded] = []

    def pull(client):
        runtime = runtimes[-1]
        message = Message(RecordDict(), dst_node_id=5, message_type="query")
        message.metadata.__dict__["_message_id"] = "m" * 64
        context = Context(run_id=1, node_id=5, node_config={}, state=RecordDict(),
                          run_config={})
        run = Run.create_empty(1)
        run.fab_id, run.fab_version = FAB_ID, FAB_VERSION
        return message, context, run, Fab(app_pin.fab_hash(runtime.fab), runtime.fab, {})

    monkeypatch.setattr(warm_runtime, "pull_task_input", pull)
    monkeypatch.setattr(warm_runtime, "push_message",
                        lambda client, reply, context: runtimes[-1].pushed.append(reply))
    monkeypatch.setattr(warm_runtime, "push_task_output",
                        lambda client, context, status, details:
                        runtimes[-1].statuses.append((status, details)))
    monkeypatch.setattr(warm_runtime, "HeartbeatSender", _NoHeartbeat)

    def make(*args, **kwargs) -> Recorded:
        runtimes.append(Recorded(*args, **kwargs))
        return runtimes[-1]
    return make


class _NoHeartbeat:
    def __init__(self, beat) -> None:
        pass

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass


def _ahead(fab: bytes):
    """What direct_runtime.fab_check reads from the SuperNode's state."""
    return lambda task: (app_pin.fab_hash(fab), app_pin.refusal(fab, FAB_ID, FAB_VERSION))


@pytest.mark.parametrize("per_message", [False, True])
def test_a_trusted_fab_is_answered_warm_or_by_one_process_per_message(fab, task_io,
                                                                    per_message):
    runtime = task_io(fab, _ahead(fab), per_message=per_message)
    for _ in range(2):
        runtime.run(Task(run_id=1, fab_hash=app_pin.fab_hash(fab)), token="t")
    assert runtime.answered == ["fresh process" if per_message else "app"] * 2
    assert runtime.verdicts == {app_pin.fab_hash(fab): None}


@pytest.mark.parametrize(("per_message", "ahead"), [(False, True), (True, True),
                                                      (False, False)])
def test_an_untrusted_fab_gets_an_error_reply_and_none_of_its_code_runs(fab, task_io, caplog,
                                                                       per_message, ahead):
    tampered = _added(fab, "dpcfl_flwr/extra.py", b"x = 1\n")
    runtime = task_io(tampered, _ahead(tampered) if ahead else None, per_message=per_message)
    with caplog.at_level("ERROR", logger="dpcfl_flwr.flower_compat.warm_runtime"):
        for _ in range(2):
            runtime.run(Task(run_id=1, fab_hash=app_pin.fab_hash(tampered)), token="t")
    assert runtime.answered == []  # neither the loaded ClientApp nor flwr-clientapp
    assert [reply.error.code for reply in runtime.pushed] == [ErrorCode.INVALID_FAB] * 2
    assert "it ships dpcfl_flwr/extra.py" in runtime.pushed[0].error.reason
    assert [status for status, _ in runtime.statuses] == [SubStatus.FAILED] * 2
    lines = [r.getMessage() for r in caplog.records if r.name.endswith("warm_runtime")]
    assert len(lines) == 1 and lines[0].startswith(f"refused FAB {app_pin.fab_hash(tampered)[:8]}")


def test_a_fab_that_cannot_be_read_ahead_is_refused_not_run(fab, task_io):
    def unreadable(task: Task):
        raise LookupError("the SuperNode holds no run 1")

    runtime = task_io(fab, unreadable, per_message=True)
    runtime.run(Task(run_id=1, fab_hash="f" * 64), token="t")
    assert runtime.answered == [] and runtime.pushed[0].error.code == ErrorCode.INVALID_FAB


def test_a_per_message_runtime_must_judge_each_fab_before_its_task_runs():
    with pytest.raises(ValueError, match="must check each FAB"):
        WarmRuntime("127.0.0.1:1", app=None, per_message=True)


def test_every_silo_answers_in_its_supernode_without_flowers_superexec():
    node = parse_node_config({"partition-id": 0})
    warm = supernode_command(SiloFile(name="s", insecure=True, runtime_port=9123), node)
    cold = supernode_command(SiloFile(name="s", insecure=True, warm=False), node)
    for command, mode in ((warm, "warm"), (cold, "per-message")):
        assert command[command.index("--isolation") + 1] == "process"
        assert command[command.index("--clientapp") + 1] == mode
    assert warm[warm.index("--port") + 1] == "9123"  # flwr-clientapp's way in (per message)


def _message_in_state(state, run_id: int, fab: bytes, *, arrived: bool) -> str:
    """A SuperNode's state holding a run, its FAB and context, a task, and a train message
    whose objects are registered and, if ``arrived``, stored (else the run stopped while the
    message was arriving, and they never came)."""
    run = Run.create_empty(run_id)
    run.fab_id, run.fab_version, run.fab_hash = FAB_ID, FAB_VERSION, app_pin.fab_hash(fab)
    state.store_run(run)
    state.store_fab(Fab(run.fab_hash, fab, {}))
    state.set_run_series_context(run.series_id, Context(
        run_id=run_id, node_id=5, node_config={}, state=RecordDict(), run_config={}))
    message = Message(RecordDict({"model": ArrayRecord({"w": Array(np.ones(4))})}),
                      dst_node_id=5, message_type="train")
    message.metadata.__dict__["_run_id"] = run_id
    message.metadata.__dict__["_message_id"] = message.object_id
    state.create_task(task_type=TaskType.CLIENT_APP, run_id=run_id, fab_hash=run.fab_hash)
    state.object_store.preregister(run_id, get_object_tree(message))
    if arrived:
        for object_id, stored in get_all_nested_objects(message).items():
            state.object_store.put(object_id, stored.deflate())
    state.store_message(message)
    return message.metadata.message_id



def _stored_run(state, run_id: int, fab: bytes, version: str = FAB_VERSION) -> Task:
    """A run of ``fab`` in a SuperNode's state, and a task of it."""
    run = Run.create_empty(run_id)
    run.fab_id, run.fab_version, run.fab_hash = FAB_ID, version, app_pin.fab_hash(fab)
    state.store_run(run)
    state.store_fab(Fab(run.fab_hash, fab, {}))
    return Task(run_id=run_id, fab_hash=run.fab_hash)


def test_a_fabs_verdict_is_remembered_by_its_own_hash_id_and_version(fab, monkeypatch):
    judged = []
    refusal = app_pin.refusal
    monkeypatch.setattr(app_pin, "refusal", lambda *a: judged.append(a[1:]) or refusal(*a))
    factory = NodeStateFactory(ObjectStoreFactory())
    state, check = factory.state(), fab_check(factory)
    first = _stored_run(state, 1, fab)
    assert [check(first) for _ in range(3)] == [(app_pin.fab_hash(fab), None)] * 3
    assert judged == [(FAB_ID, FAB_VERSION)]  # unpacked and compared once, not per message
    tampered = _added(fab, "dpcfl_flwr/extra.py", b"x = 1\n")
    digest, refused = check(_stored_run(state, 2, tampered))
    assert digest == app_pin.fab_hash(tampered) and "extra.py" in refused
    _, refused = check(_stored_run(state, 3, fab, version="9.9.9"))  # same bytes, other run
    assert "9.9.9" in refused
    assert len(judged) == 3
    for run_id in range(4, 4 + REMEMBERED_VERDICTS):  # a server sending ever new FABs ...
        check(_stored_run(state, run_id, _added(fab, "x", str(run_id).encode())))
    check(first)  # ... pushes the oldest verdicts out: judged again, not kept without bound
    assert len(judged) == 3 + REMEMBERED_VERDICTS + 1

@pytest.mark.parametrize("ended_by", ["the SuperNode dropped it", "the next run's message"])
def test_a_stopped_runs_leftover_task_is_dropped_within_seconds(fab, task_identity, ended_by):
    # A run stopped mid-round leaves a message whose objects never arrive; Flower's pull
    # retried them for two hours while every later run of the silo waited behind it.
    task_identity(0, 0, 0)
    factory = NodeStateFactory(ObjectStoreFactory())
    state = factory.state()
    leftover = _message_in_state(state, 7, fab, arrived=False)
    runtime = WarmRuntime("127.0.0.1:1", ClientApp(), connect=direct_link(factory),
                          check_fab=fab_check(factory))
    acquired = DirectRuntimeClient(factory).AcquireTask(
        AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP.value]))
    answered = threading.Thread(target=runtime.run, args=(acquired.task, acquired.token),
                                daemon=True)
    answered.start()
    time.sleep(0.5)
    assert answered.is_alive()  # waits while the message may still arrive
    stopped = time.monotonic()
    if ended_by == "the SuperNode dropped it":
        state.delete_messages(message_ids=[leftover])
    else:
        _message_in_state(state, 8, fab, arrived=False)
    answered.join(timeout=15)
    assert not answered.is_alive() and time.monotonic() - stopped < 5
    task = state.get_tasks(task_ids=[acquired.task.task_id])[0]
    assert task.status.sub_status == SubStatus.FAILED and "stale task" in task.status.details
    assert not state.get_messages(run_ids=[7], is_reply=True)  # nobody waits for a reply


def _supernode_holding_a_train_message(fab: bytes) -> tuple[NodeStateFactory, Any, str]:
    """(state factory, state, message id): a SuperNode's state holding a run of ``fab`` and
    a train message for it whose objects are all in."""
    factory = NodeStateFactory(ObjectStoreFactory())
    state = factory.state()
    return factory, state, _message_in_state(state, 7, fab, arrived=True)


def _answer_its_task(factory: NodeStateFactory, runtime: WarmRuntime) -> Any:
    """Acquire the state's pending task as the SuperExec does and let ``runtime`` answer it;
    returns the acquisition (task and token)."""
    acquired = DirectRuntimeClient(factory).AcquireTask(
        AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP.value]))
    runtime.run(acquired.task, acquired.token)
    return acquired


@pytest.mark.parametrize("judged_ahead", [True, False])
def test_a_task_answered_in_the_supernode_gets_its_fab_judged_from_the_state(
        fab, task_identity, judged_ahead):
    # The direct link hands the task its FAB without the content (a ~1 MB copy per message):
    # judged ahead from the SuperNode's state, the task runs; a runtime that judged the
    # FAB in the task's input instead would see no app there and refuse it (fail closed).
    task_identity(0, 0, 0)
    factory, state, asked = _supernode_holding_a_train_message(fab)
    answered: list[Message] = []
    app = ClientApp()

    @app.train()
    def train(message: Message, context: Context) -> Message:
        answered.append(message)
        return Message(RecordDict({"model": message.content["model"]}), reply_to=message)

    inputs = []

    def link(token):  # the direct link, recording the task inputs it hands out
        client = direct_link(factory)(token)
        pull = client.PullTaskInput
        client.PullTaskInput = lambda request: inputs.append(pull(request)) or inputs[-1]
        return client

    runtime = WarmRuntime("127.0.0.1:1", app, connect=link,
                          check_fab=fab_check(factory) if judged_ahead else None)
    acquired = _answer_its_task(factory, runtime)
    [task_input] = inputs
    assert task_input.fab.hash_str == app_pin.fab_hash(fab) and not task_input.fab.content
    [reply] = state.get_messages(run_ids=[7], is_reply=True)
    assert reply.metadata.reply_to_message_id == asked
    task = state.get_tasks(task_ids=[acquired.task.task_id])[0]
    if judged_ahead:
        assert [m.metadata.message_id for m in answered] == [asked]
        assert task.status.sub_status == SubStatus.COMPLETED
        assert not reply.has_error()
    else:
        assert not answered
        assert reply.error.code == ErrorCode.INVALID_FAB
        assert "not a readable FAB" in reply.error.reason


def test_the_apps_clean_up_runs_once_its_reply_is_stored_and_the_supernode_told(
        fab, task_identity):
    # A silo's heap trim (runs/heap.py) waits for the reply: the SuperNode pushes the reply
    # while the ClientApp's thread gives memory back, instead of after it.
    task_identity(0, 0, 0)
    factory, state, asked = _supernode_holding_a_train_message(fab)
    events: list[str] = []
    app = ClientApp()

    @app.train()
    def train(message: Message, context: Context) -> Message:
        after_reply(lambda: events.append("clean-up"))
        events.append("handled")
        return Message(RecordDict({"model": message.content["model"]}), reply_to=message)

    def told() -> None:
        replies = state.get_messages(run_ids=[7], is_reply=True)
        events.append(f"told, {len(replies)} reply to {replies[0].metadata.reply_to_message_id}")

    runtime = WarmRuntime("127.0.0.1:1", app, connect=direct_link(factory),
                          check_fab=fab_check(factory), on_task_done=told)
    _answer_its_task(factory, runtime)
    assert events == ["handled", f"told, 1 reply to {asked}", "clean-up"]
    after_reply(lambda: events.append("at once"))  # no reply being sent: now
    assert events[-1] == "at once"
