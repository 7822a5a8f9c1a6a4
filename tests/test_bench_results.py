"""Recording a bench run: its section replaces the current one of the same title in RESULTS.md
(never a second copy), leaves every other section as it was, and grows the bench's history."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import common

CURRENT = """# Benchmark results

Header text.

<!-- contents -->
- [stale entry](#stale-entry)
<!-- /contents -->

## DP-SGD throughput

`python bench/dp_throughput.py` — 2026-11-24 17:37 UTC, commit c635c2d
(old machine)

| old | table |
|---|---|

A hand note on the old figure.

## End to end: the quick example

`python bench/e2e_quick.py` — 2026-11-24 19:45 UTC, commit fe02223
(old machine)

| seed | acc |
|---|---|
| 0 | 57.8% |

### A subsection that belongs to it

Its text.

## End to end: the quick example (seed 0, after the malicious-server changes)

A hand-titled section no bench writes.
"""


@pytest.fixture
def files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    monkeypatch.setattr(common, "machine", lambda: "test machine")
    monkeypatch.setattr(common, "commit", lambda: "abc1234")
    monkeypatch.setattr("sys.argv", ["bench/e2e_quick.py", "--seeds", "0,1"])
    results = tmp_path / "RESULTS.md"
    results.write_text(CURRENT)
    return results, tmp_path / "history"


def _split_sections(text: str) -> list[str]:
    """``text`` cut before every level-2 heading: the preamble, then one piece per section
    (a section runs to the next ``## `` line, its ``###`` subsections and notes included)."""
    pieces: list[str] = [""]
    for line in text.splitlines(keepends=True):
        if line.startswith("## "):
            pieces.append("")
        pieces[-1] += line
    return pieces


def sections(text: str) -> dict[str, str]:
    return {piece.splitlines()[0][3:]: piece for piece in _split_sections(text)[1:]}


def test_a_run_replaces_its_own_section_only(files: tuple[Path, Path]) -> None:
    results, history = files
    common.publish("End to end: the quick example", "| seed | acc |\n| 0 | 60.1% |", True,
                   results=results, history=history)
    before, after = sections(CURRENT), sections(results.read_text())
    assert list(after) == list(before)
    assert results.read_text().count("## End to end: the quick example\n") == 1
    replaced = after["End to end: the quick example"]
    assert "60.1%" in replaced and "57.8%" not in replaced and "subsection" not in replaced
    assert "`python bench/e2e_quick.py --seeds 0,1` — " in replaced
    assert "commit abc1234\n(test machine)" in replaced
    for title in before:
        if title != "End to end: the quick example":
            assert after[title] == before[title]
    assert results.read_text().startswith("# Benchmark results\n\nHeader text.\n")


def test_the_history_grows_with_every_run(files: tuple[Path, Path]) -> None:
    results, history = files
    for accuracy in ("60.1%", "59.4%"):
        common.append_results("End to end: the quick example", f"| 0 | {accuracy} |",
                              results=results, history=history)
    log = (history / "e2e_quick.md").read_text()
    assert log.startswith("# History of bench/e2e_quick.py")
    assert log.count("## End to end: the quick example\n") == 2
    assert log.index("60.1%") < log.index("59.4%")
    current = results.read_text()
    assert "59.4%" in current and "60.1%" not in current
    assert current.count("## End to end: the quick example\n") == 1


def test_a_new_title_gets_its_own_section_and_contents_entry(files: tuple[Path, Path]) -> None:
    results, history = files
    title = "End to end: the quick example with budget-mode=joint"
    common.publish(title, "| 0 | 58.9% |", True, results=results, history=history)
    text = results.read_text()
    assert list(sections(text))[-1] == title
    assert sections(text)["End to end: the quick example"] == sections(CURRENT)[
        "End to end: the quick example"]
    assert f"- [{title}](#end-to-end-the-quick-example-with-budget-modejoint)" in text
    assert "stale entry" not in text
    assert text.count("\n- [") == 4  # the sections; the subsection is listed indented
    assert "\n  - [A subsection that belongs to it](#a-subsection-that-belongs-to-it)" in text


def test_no_append_only_prints(files: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) \
        -> None:
    results, history = files
    common.publish("DP-SGD throughput", "| new | table |", False, results=results,
                   history=history)
    assert results.read_text() == CURRENT
    assert not history.exists()
    assert "| new | table |" in capsys.readouterr().out


GROUPED = """# Benchmark results

<!-- contents -->
<!-- /contents -->

## How fast is DP-SGD here?

What the figures below answer, in a line.

### DP-SGD throughput

`python bench/dp_throughput.py` — old

| old | table |

### Choices inside the layerwise engine

| kept | as it was |

## How does the quick example do?

### End to end: the quick example

| 0 | 57.8% |
"""


def test_a_figure_is_replaced_under_the_question_it_answers(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    monkeypatch.setattr(common, "machine", lambda: "test machine")
    monkeypatch.setattr(common, "commit", lambda: "abc1234")
    monkeypatch.setattr("sys.argv", ["bench/dp_throughput.py"])
    results = tmp_path / "RESULTS.md"
    results.write_text(GROUPED)
    common.publish("DP-SGD throughput", "| new | table |", True, results=results,
                   history=tmp_path / "history")
    text = results.read_text()
    question, figure = text.index("## How fast is DP-SGD here?"), text.index(
        "### DP-SGD throughput\n\n`python bench/dp_throughput.py` — ")
    assert question < figure < text.index("### Choices inside the layerwise engine")
    assert "| new | table |" in text and "| old | table |" not in text
    assert "| kept | as it was |" in text and "What the figures below answer" in text
    assert text.count("DP-SGD throughput\n") == 1
    assert ("- [How fast is DP-SGD here?](#how-fast-is-dp-sgd-here)\n"
            "  - [DP-SGD throughput](#dp-sgd-throughput)\n") in text
    history = (tmp_path / "history" / "dp_throughput.md").read_text()
    assert "## DP-SGD throughput\n" in history  # the history stays flat
