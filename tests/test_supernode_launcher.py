"""The SuperNode launcher shortens exactly Flower's two poll waits, and only on flwr 1.39.0."""

from __future__ import annotations

import time

import flwr
import pytest
from flwr.supernode import start_client_internal as loop

from dpcfl_flwr.deploy.supernode_launcher import (
    FLOWER_IDLE_WAIT,
    FLOWER_REPLY_WAIT,
    PATCHED_FLOWER,
    ShortWaits,
    shorten_waits,
    split_arguments,
)


def test_the_installed_flower_loop_still_has_the_waits_the_launcher_shortens():
    source = open(loop.__file__).read()  # noqa: SIM115 - read once, closed by GC
    assert flwr.__version__ == PATCHED_FLOWER
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


def test_shorten_waits_patches_the_real_loop_only_for_the_known_version(monkeypatch):
    monkeypatch.setattr(loop, "time", time)
    assert not shorten_waits(loop, "1.40.0", 0.5) and loop.time is time
    assert shorten_waits(loop, PATCHED_FLOWER, 0.5)
    assert isinstance(loop.time, ShortWaits) and loop.time.idle_poll == 0.5
    assert not shorten_waits(loop, PATCHED_FLOWER, 0.5)  # already patched: not twice


def test_split_arguments_takes_the_idle_poll_and_passes_everything_else_on():
    assert split_arguments(["--idle-poll", "0.25", "--superlink", "h:1", "--insecure"]) == (
        0.25, ["--superlink", "h:1", "--insecure"])
    assert split_arguments(["--idle-poll=1", "--grpc-rere"]) == (1.0, ["--grpc-rere"])
    assert split_arguments(["--insecure"])[0] == 0.5
