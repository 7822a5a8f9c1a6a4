"""docs/own-data.md's walkthrough "From a fresh clone to three silos on your own CSV files", run
as the page writes it, on 127.0.0.1 with TLS and node authentication: `federation.toml` from
the page's run config, `server/make-certs.sh`, `dpcfl topology silos`,
`server/start-superlink.sh`, the page's `[node]` lines added to each silo's file with its own
CSV file and budget, `dpcfl data check`, three `dpcfl client` silos and `dpcfl submit`.

The page's code blocks are read from docs/own-data.md and run in a copy of this checkout (as
tests/test_readme_deployment.py does README's), so a change of the page that breaks the
walkthrough fails here. What the test changes: hosts and ports (127.0.0.1 and free ports for
superlink.example.org:9092 and 8000, the silos' runtime ports added as flags), paths (each
silo's `data-path`, the run's `out-dir`), each silo's `epsilon` and `delta`, and a small run
(`--set` flags on `dpcfl submit`, which win over federation.toml). The tables are 200 rows of
the page's columns, drawn from one seeded rule (with a different population per silo) that
relates the outcome to age, blood pressure and sex.
"""

from __future__ import annotations

import json
import math
import re
import time
import tomllib
from pathlib import Path

import numpy as np
import pytest

from dpcfl_flwr.data.schema import parse_features
from dpcfl_flwr.data.sources import draw_split
from dpcfl_flwr.deploy.localhost import free_port
from dpcfl_flwr.deploy.silo_file import deployed_settings, load_silo_file
from tests.doc_commands import (
    REPO,
    Operator,
    code_blocks,
    copy_of_the_checkout,
    only_command,
    section,
    shell_commands,
)

PAGE = REPO / "docs" / "own-data.md"
HEADING = "From a fresh clone to three silos on your own CSV files"
WHERE = f"docs/own-data.md's section {HEADING!r}"
SILOS = 3
ROWS = 200
#: Each silo's own budget (epsilon, delta), set in its file.
BUDGETS = ((3.0, 1e-5), (5.0, 1e-5), (8.0, 1e-4))
SMALL_RUN = ["num-server-rounds=3", "eval-every=3", "wait-for-clients=300.0"]


class Page:
    """The walkthrough's run config, `[node]` lines and commands, as the page writes them."""

    def __init__(self) -> None:
        text = section(PAGE, HEADING)
        tomls = code_blocks(text, "toml")
        assert len(tomls) == 2, f"{WHERE}: expected 2 toml blocks (federation.toml, the " \
                                f"silo's [node] lines), found {len(tomls)}"
        self.federation, self.node_lines = tomls
        self.commands = [c for b in code_blocks(text, "bash") for c in shell_commands(b)]
        self.used: list[list[str]] = []

    def command(self, *start: str) -> list[str]:
        found = only_command(self.commands, *start, where=WHERE)
        self.used.append(found)
        return found

    def check_all_used_in_order(self) -> None:
        """The test runs every command of the page, in the page's order."""
        said, run = ([" ".join(c) for c in cs] for cs in (self.commands, self.used))
        assert said == run, f"{WHERE}: its commands are\n  " + "\n  ".join(said) + \
            "\nand this test runs\n  " + "\n  ".join(run)


def _on_this_machine(command: list[str], fleet: int, api: int) -> list[str]:
    """``command`` with the SuperLink's host:ports (Fleet API 9092, control API 8000) made
    127.0.0.1 and free ports."""
    local = []
    for arg in command:
        arg = re.sub(r"^[\w.-]+:9092$", f"127.0.0.1:{fleet}", arg)
        local.append(re.sub(r"^127\.0\.0\.1:8000$", f"127.0.0.1:{api}", arg))
    return local


def _write_table(path: Path, silo: int) -> None:
    """``ROWS`` records of the page's columns: an outcome more likely with age, blood pressure
    and male sex; each silo's population a little older and of higher pressure than the one
    before."""
    rng = np.random.default_rng(silo)
    age = rng.normal(45 + 5 * silo, 12, ROWS).round()
    bp = rng.normal(115 + 5 * silo, 18, ROWS).round()
    sex = rng.choice(["f", "m"], ROWS)
    risk = 0.08 * (age - 50) + 0.05 * (bp - 120) + 1.0 * (sex == "m") - 0.5
    outcome = (risk + rng.logistic(0.0, 0.5, ROWS) > 0).astype(int)
    rows = (f"{a:.0f},{b:.0f},{s},{o}" for a, b, s, o in zip(age, bp, sex, outcome, strict=True))
    path.write_text("\n".join(["age,bp,sex,outcome", *rows]) + "\n")


def _set_key(text: str, key: str, value: str) -> str:
    """``text`` (a silo file whose last table is [node]) with ``key = value``: the line
    changed where the file has it, else added at the end."""
    line = f"{key} = {value}"
    changed, count = re.subn(rf"^{re.escape(key)} = .*$", line, text, count=1,
                             flags=re.MULTILINE)
    return changed if count else f"{text.rstrip()}\n{line}\n"


def _own_records(root: Path, page: Page, silo: int) -> Path:
    """Silo ``silo``'s table, its file with the page's [node] lines (its own data-path) and
    its budget; returns the file."""
    table = root / "data" / f"site-{silo}.csv"
    _write_table(table, silo)
    lines, count = re.subn(r'^data-path = ".*"', f'data-path = "{table}"', page.node_lines,
                           flags=re.MULTILINE)
    assert count == 1, f"{WHERE}: the silo's [node] lines have no data-path"
    silo_file = root / "clients" / f"silo-{silo:02d}.toml"
    text = silo_file.read_text()
    assert re.findall(r"^\[.*\]$", text, flags=re.MULTILINE)[-1:] == ["[node]"], \
        f"{silo_file.name}: [node] is not its last table: lines added at its end are not in it"
    text = f"{text.rstrip()}\n{lines}"
    epsilon, delta = BUDGETS[silo]
    silo_file.write_text(_set_key(_set_key(text, "epsilon", str(epsilon)), "delta", str(delta)))
    return silo_file


def _drawn_split(silo_file: Path) -> dict[str, int]:
    """The sizes of the split the table source draws for this silo (no split column): with
    its data-seed and fractions, as the silo resolves them."""
    settings = deployed_settings(load_silo_file(silo_file, {"name": silo_file.stem}, {})[1])
    drawn = draw_split(ROWS, int(settings.data_seed or 0), float(settings.val_fraction or 0),
                       float(settings.test_fraction or 0))
    return {part: len(rows) for part, rows in drawn.items()}


@pytest.mark.slow
def test_own_data_walkthrough_runs_three_silos_on_their_own_csv_files(tmp_path):
    page = Page()
    schema = tomllib.loads(page.federation)
    assert [f.name for f in parse_features(schema["features"])] == \
        ["age", "bp", "sex"] and schema["label-column"] == "outcome", \
        f"{WHERE}: the test's tables hold age, bp, sex and outcome; the page's schema is " \
        f"{schema['features']!r}, label {schema['label-column']!r}"
    make_certs = page.command("server/make-certs.sh")
    topology = page.command(".venv/bin/dpcfl", "topology", "silos")
    start_superlink = page.command("server/start-superlink.sh")
    check = page.command(".venv/bin/dpcfl", "data", "check")
    client = page.command(".venv/bin/dpcfl", "client")
    submit = page.command(".venv/bin/dpcfl", "submit")
    page.check_all_used_in_order()

    copy_of_the_checkout(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "federation.toml").write_text(page.federation)
    operator = Operator(tmp_path)
    fleet, api = free_port(), free_port()
    ports = ["--fleet-address", f"0.0.0.0:{fleet}", "--api-address", f"127.0.0.1:{api}"]
    started = time.monotonic()
    try:
        for name, command in (("make-certs", make_certs), ("topology", topology)):
            done = operator.run(name, _on_this_machine(command, fleet, api), timeout=300)
            assert done.returncode == 0, f"{' '.join(command)}:\n{operator.log(name)}"
        operator.start("superlink", [*start_superlink, *ports])
        silo_files = [_own_records(tmp_path, page, i) for i in range(SILOS)]

        checked = operator.run("data-check", check, timeout=300)
        assert checked.returncode == 0, f"{' '.join(check)}:\n{operator.log('data-check')}"
        split = _drawn_split(silo_files[0])
        assert re.search(r"fits the schema\s*│\s*yes", checked.stdout), checked.stdout
        assert f"{split['train']} / {split['val']} / {split['test']}" in checked.stdout, \
            checked.stdout

        operator.wait_for("superlink", "ready:", timeout=300)
        for silo_file in silo_files:
            silo = [f"clients/{silo_file.name}" if a.startswith("clients/silo-") else a
                    for a in client]
            operator.start(silo_file.stem, [*silo, "--runtime-port", str(free_port())])
        command = _on_this_machine(submit, fleet, api)
        command = [f'out-dir="{tmp_path / "run1"}"' if a.startswith("out-dir=") else a
                   for a in command]
        for setting in SMALL_RUN:
            command += ["--set", setting]
        done = operator.run("submit", command, timeout=900)
        assert done.returncode == 0, operator.log("submit")
        print(f"\nown-data walkthrough: {time.monotonic() - started:.0f} s")
    finally:
        operator.kill_all()

    results = json.loads((tmp_path / "run1" / "results.json").read_text())
    assert results["complete"] and results["method"] == schema["method"]
    clients = {c["partition"]: c for c in results["clients"]}
    assert sorted(clients) == list(range(SILOS))
    for i, silo_file in enumerate(silo_files):
        silo, (epsilon, delta) = clients[i], BUDGETS[i]
        assert silo["num_train"] == _drawn_split(silo_file)["train"], silo
        assert silo["epsilon_budget"] == epsilon and silo["delta"] == delta, silo
        assert 0 < silo["epsilon_spent"] <= epsilon, silo
        # A deployed silo reports its metrics privately (docs/privacy.md): a noisy estimate,
        # which on 40 test records may fall outside [0, 1]; present and finite is the claim.
        assert silo["test_accuracy"] is not None and math.isfinite(silo["test_accuracy"]), silo
        assert not silo["stale"] and not silo["dropped_rounds"], silo
