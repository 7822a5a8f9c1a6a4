"""What `dpcfl submit` reads from `flwr run --stream` and `flwr ls`: the run id, the
ServerApp's own error line, and the one line that says why a finished run did not complete
(the real SuperLink path is tests/test_run_ends.py)."""

from __future__ import annotations

from pathlib import Path

from dpcfl_flwr.deploy.runs import RunStatus, StreamWatch, follow_hint

STREAM = """\
Using SuperLink: dpcfl-submit (127.0.0.1:8000)
\x1b[32mSuccessfully started run 742349896378720516\x1b[0m
\x1b[92mINFO \x1b[0m:      Start `flwr-serverapp` process
ERROR dpcfl_flwr.strategies.strategy: round 3: silo 2 failed (code 4002): it went away
ERROR dpcfl_flwr: 0 of 3 silos can run (3 did not connect within 2 s); at least 1 needed
\x1b[91mERROR \x1b[0m:     ServerApp raised an exception
dpcfl_flwr.strategies.silos.TooFewSilos: 0 of 3 silos can run (3 did not connect within 2 s)
\x1b[91mERROR \x1b[0m:     Exit Code: 201
"""
TOO_FEW = "0 of 3 silos can run (3 did not connect within 2 s); at least 1 needed"


def test_the_stream_gives_the_run_id_and_the_serverapps_own_error_line():
    watch = StreamWatch()
    for line in STREAM.splitlines(keepends=True):
        watch.see(line)
    assert watch.run_id == 742349896378720516
    assert watch.app_error == TOO_FEW  # not a round's error from a module logger


def test_a_finished_run_says_why_it_did_not_complete():
    failed = RunStatus("finished:failed", f"ServerApp failed with exception: {TOO_FEW}")
    assert failed.failure("the ServerApp's own line") == "the ServerApp's own line"
    assert failed.failure(None) == TOO_FEW  # Flower's details, without its prefix
    assert RunStatus("finished:failed").failure() == "the run ended failed"
    assert "stopped on the SuperLink" in RunStatus("finished:stopped").failure()
    assert RunStatus("finished:completed").failure("stray line") is None
    running = RunStatus("running")
    assert not running.finished and running.failure() is None


def test_the_hint_names_the_run_connection_and_home():
    hint = follow_hint(7, "dpcfl-submit", Path("/srv/flwr"))
    assert "`FLWR_HOME=/srv/flwr flwr log 7 dpcfl-submit` follows it" in hint
    assert "`FLWR_HOME=/srv/flwr flwr stop 7 dpcfl-submit` stops it" in hint
    assert "flwr ls dpcfl-submit` lists the runs" in hint
    assert follow_hint(None, "x", Path.home() / ".flwr").startswith("`flwr log RUN-ID x`")
