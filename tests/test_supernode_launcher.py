"""The SuperNode launcher shortens exactly Flower's two poll waits, and only with the tuning on;
its Runtime API ticks once a second; an in-process ClientApp ends the reply wait; no option that
would run other code than the installed app gets through."""

from __future__ import annotations

import threading
import time
import urllib.request

import flwr
import pytest
import uvicorn
from flwr.supernode import start_client_internal as loop

from dpcfl_flwr.deploy.supernode_launcher import split_arguments, unpinned_options
from dpcfl_flwr.flower_compat import SUPPORTED_FLOWER
from dpcfl_flwr.flower_compat.supernode import (
    FLOWER_IDLE_WAIT,
    FLOWER_REPLY_WAIT,
    ShortWaits,
    shorten_waits,
    skip_connectivity_watch,
    slow_runtime_api_tick,
    stop_after_a_failed_heartbeat,
)


def test_the_installed_flower_loop_still_has_the_waits_the_launcher_shortens():
    source = open(loop.__file__).read()  # noqa: SIM115 - read once, closed by GC
    assert flwr.__version__ == SUPPORTED_FLOWER
    assert f"time.sleep({FLOWER_IDLE_WAIT:g})" in source
    assert f"time.sleep({FLOWER_REPLY_WAIT})" in source


def test_short_waits_maps_flowers_constants_and_leaves_other_sleeps_alone():
    waits = ShortWaits(0.2)
    for requested, expected in ((FLOWER_IDLE_WAIT, 0.2), (FLOWER_REPLY_WAIT, 0.1),
                                (0.05, 0.05)):
        started = time.perf_counter()
        waits.sleep(requested)
        assert expected <= time.perf_counter() - started < expected + 0.15
    assert waits.monotonic is time.monotonic and waits.time is time.time
    assert ShortWaits(2.0).reply_poll == 0.2 and ShortWaits(30).reply_poll == FLOWER_REPLY_WAIT
    with pytest.raises(ValueError, match="positive"):
        ShortWaits(0)


def test_the_idle_wait_counts_from_the_previous_polls_start():
    # A SuperLink that held the empty poll (flower_compat/superlink.py) made the silo wait
    # already: the SuperNode asks again at once. A poll answered at once waits the full time.
    waits = ShortWaits(0.3)
    waits.sleep(FLOWER_IDLE_WAIT)
    time.sleep(0.4)  # a held poll
    started = time.perf_counter()
    waits.sleep(FLOWER_IDLE_WAIT)
    assert time.perf_counter() - started < 0.05
    time.sleep(0.1)  # a poll answered within 0.1 s
    started = time.perf_counter()
    waits.sleep(FLOWER_IDLE_WAIT)
    assert 0.15 <= time.perf_counter() - started < 0.3


def test_shorten_waits_patches_the_real_loop_once(monkeypatch):
    monkeypatch.setattr(loop, "time", time)
    assert shorten_waits(loop, 0.5)
    assert isinstance(loop.time, ShortWaits) and loop.time.idle_poll == 0.5
    assert not shorten_waits(loop, 0.5)  # already patched: not twice


def test_split_arguments_takes_our_options_and_passes_everything_else_on():
    options, rest = split_arguments(["--idle-poll", "0.25", "--superlink", "h:1", "--insecure"])
    assert (options.idle_poll, options.clientapp, rest) == (
        0.25, "warm", ["--superlink", "h:1", "--insecure"])
    options, rest = split_arguments(["--clientapp", "per-message", "--idle-poll=1",
                                     "--grpc-rere"])
    assert (options.idle_poll, options.clientapp, rest) == (1.0, "per-message", ["--grpc-rere"])
    assert split_arguments(["--insecure"])[0].idle_poll == 0.5


def test_options_that_would_run_code_other_than_the_installed_app_are_named():
    # Flower's SuperExec runs whatever the FAB ships; dependency installation, any package
    assert unpinned_options(["--isolation", "process", "--insecure"]) == []
    assert unpinned_options(["--isolation", "subprocess"]) == ["--isolation subprocess"]
    assert unpinned_options(["--isolation=subprocess"]) == ["--isolation subprocess"]
    assert unpinned_options(["--allow-runtime-dependency-installation"]) == [
        "--allow-runtime-dependency-installation"]


def test_the_reply_wait_ends_when_an_in_process_clientapp_says_it_is_done():
    done = threading.Event()
    waits = ShortWaits(0.3, reply_stored=done)  # without a ClientApp to say so: 0.1 s checks
    threading.Timer(0.05, done.set).start()
    started = time.perf_counter()
    waits.sleep(FLOWER_REPLY_WAIT)
    assert time.perf_counter() - started < 0.3 and not done.is_set()  # woken, then re-armed
    started = time.perf_counter()
    # nothing done: Flower's own wait, not the short checks (the ClientApp will say when)
    waits.sleep(FLOWER_REPLY_WAIT)
    assert FLOWER_REPLY_WAIT <= time.perf_counter() - started < FLOWER_REPLY_WAIT + 0.2


def test_the_runtime_api_ticks_once_a_second_and_still_serves_and_stops(monkeypatch):
    monkeypatch.setattr(uvicorn.Server, "main_loop", uvicorn.Server.main_loop)  # restored after
    assert slow_runtime_api_tick(uvicorn.Server)
    assert not slow_runtime_api_tick(object)
    ticks = []

    async def app(scope, receive, send):  # a minimal ASGI app: 200 "ok"
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error"))
    original_tick = server.on_tick

    async def counted(counter: int) -> bool:
        ticks.append(counter)
        return await original_tick(counter)

    server.on_tick = counted
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    assert urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5).read() == b"ok"
    time.sleep(2.0)
    assert 2 <= len(ticks) <= 4 and all(t % 10 == 0 for t in ticks)  # uvicorn's own: ~20
    server.should_exit = True
    thread.join(timeout=3)
    assert not thread.is_alive()


def _watched(channel) -> bool:
    """Whether gRPC runs its connectivity-poll thread for this channel (gRPC's own flag)."""
    return channel._connectivity_state.polling


def test_the_channels_connectivity_watch_is_left_out(monkeypatch):
    from flwr.client.grpc_rere_client import connection

    flowers = connection.create_channel
    monkeypatch.setattr(connection, "create_channel", flowers)  # restored afterwards
    # Flower's channel: a subscription starts gRPC's thread that polls the channel at 5 Hz.
    plain = flowers(server_address="127.0.0.1:9", insecure=True)
    watcher = lambda state: None  # noqa: E731
    plain.subscribe(watcher)
    assert _watched(plain)
    plain.unsubscribe(watcher)  # gRPC's thread then ends by itself, not on a closed channel
    deadline = time.monotonic() + 10
    while _watched(plain):
        assert time.monotonic() < deadline, "gRPC's poll thread outlived its last subscriber"
        time.sleep(0.05)
    plain.close()
    assert skip_connectivity_watch(connection)
    quiet = connection.create_channel(server_address="127.0.0.1:9", insecure=True)
    quiet.subscribe(lambda state: None)
    time.sleep(0.1)
    assert not _watched(quiet)
    quiet.close()


def _ended_after_a_refused_heartbeat(sender_class: type) -> object:
    """A started ``sender_class`` whose first heartbeat raised, as the gRPC heartbeat does
    when a SuperLink restarted without its state refuses the node id; its thread has ended."""
    def refused() -> bool:
        raise RuntimeError("UNAUTHENTICATED: Invalid node ID (raised on purpose)")

    sender = sender_class(refused)
    sender.start()
    sender._thread.join(timeout=10)
    assert not sender._thread.is_alive()
    return sender


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_supernode_whose_heartbeat_was_refused_still_says_goodbye():
    from flwr.supercore.heartbeat import HeartbeatSender

    # Flower's own: the goodbye's stop raises, and the SuperNode exits 1
    with pytest.raises(RuntimeError, match="not running"):
        _ended_after_a_refused_heartbeat(HeartbeatSender).stop()
    patched = type("Sender", (HeartbeatSender,), {})
    stop_after_a_failed_heartbeat(patched)
    _ended_after_a_refused_heartbeat(patched).stop()  # returns
    beats = threading.Event()
    alive = patched(lambda: beats.set() or True)  # a live sender still stops and joins
    alive.start()
    assert beats.wait(10)
    alive.stop()
    assert not alive._thread.is_alive()
