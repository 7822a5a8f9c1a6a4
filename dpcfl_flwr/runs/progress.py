"""A live view of a run, read from the ``progress.jsonl`` its ServerApp writes.

Reading the file (rather than hooking into the server) works the same for a simulation in
this process, a ``flwr run`` on a SuperLink, or a deployment whose results directory is
mounted here.
"""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table


def percent(value: Any) -> str:
    """An accuracy as a percentage; ``-`` when it is unknown (a silo with private metrics
    reports no validation accuracy) or not a finite number."""
    if not _known(value):
        return "-"
    return f"{100 * value:.1f}%"


def _known(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def describe_round(row: dict[str, Any]) -> str:
    """One line: stage, cluster sizes, accuracy, epsilon (test accuracy in evaluated rounds)."""
    parts = [f"[cyan]{row['stage']}[/]", f"sizes {row['cluster_sizes']}",
             f"val acc {percent(row.get('mean_val_accuracy'))}"]
    if _known(row.get("mean_test_accuracy")):
        parts.append(f"test acc {percent(row['mean_test_accuracy'])}")
    if _known(row.get("minority_test_accuracy")):
        parts.append(f"minority {percent(row['minority_test_accuracy'])}")
    if _known(row.get("mean_test_balanced_accuracy")):
        parts.append(f"balanced {percent(row['mean_test_balanced_accuracy'])}")
    if _known(row.get("mean_test_auroc")):
        parts.append(f"AUROC {row['mean_test_auroc']:.3f}")
    if _known(row.get("max_epsilon_spent")):
        parts.append(f"eps {row['max_epsilon_spent']:.2f}")
    if row.get("refused"):
        parts.append(f"[yellow]refused {row['refused']}[/]")
    if row.get("dropped"):
        parts.append(f"[red]dropped {row['dropped']}[/]")
    return " | ".join(parts)


class ProgressTail:
    """The events appended to a ``progress.jsonl`` since the last call; a line still being
    written is left for the next call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def new_events(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        events = []
        with self.path.open() as handle:
            handle.seek(self.offset)
            for line in handle:
                if not line.endswith("\n"):
                    break
                self.offset += len(line.encode())
                events.append(json.loads(line))
        return events


class ProgressFollower(threading.Thread):
    """Tails ``progress.jsonl`` and shows round, stage, cluster sizes, accuracy and epsilon."""

    def __init__(self, out_dir: Path, rounds: int, console: Console) -> None:
        super().__init__(daemon=True)
        self.tail = ProgressTail(out_dir / "progress.jsonl")
        self.stop_event = threading.Event()
        self.progress = Progress(
            TextColumn("round {task.completed}/{task.total}"), BarColumn(),
            TimeElapsedColumn(), TextColumn("{task.description}"), console=console)
        self.task = self.progress.add_task("starting Flower simulation (Ray) ...", total=rounds)

    def run(self) -> None:
        with self.progress:
            while not self.stop_event.wait(0.5):
                self._read()
            self._read()

    def _read(self) -> None:
        for event in self.tail.new_events():
            self._show(event)

    def _show(self, event: dict[str, Any]) -> None:
        if event.get("event") == "start":
            self.progress.update(self.task, description=f"{event['silos']} silos connected")
        elif event.get("event") == "round":
            self.progress.update(self.task, completed=event["round"],
                                 description=describe_round(event))
            self.progress.console.print(f"round {event['round']:>3}: {describe_round(event)}",
                                        highlight=False)

    def stop(self) -> None:
        self.stop_event.set()
        self.join(timeout=5)


def summary_table(results: dict[str, Any]) -> Table:
    """The end-of-run table: accuracy overall, balanced accuracy and (two classes) AUROC,
    accuracy of the minority / majority clusters (over the silos evaluated at the end; stale
    figures named apart), clustering, privacy."""
    summary, clustering = results["summary"], results["clustering"]
    table = Table(title=f"{results['method']} — {results['config']['out-dir']}",
                  show_header=False)

    table.add_row("mean test accuracy", percent(summary.get("mean_accuracy"))
                  + _evaluated(summary))
    table.add_row("mean balanced accuracy", percent(summary.get("mean_balanced_accuracy")))
    if _known(summary.get("mean_auroc")):  # two classes only
        table.add_row("mean AUROC", f"{summary['mean_auroc']:.3f}")
    stale = summary.get("stale_silos") or {}
    if stale:
        table.add_row("stale (not in the means)", ", ".join(
            f"silo {p} (round {r})" for p, r in sorted(stale.items(), key=lambda i: int(i[0]))))
    if any(c["true_cluster"] < 0 for c in results["clients"]):
        table.add_row("true groups", "unknown (own records without true-cluster): no "
                      "minority or ARI to report")
    elif summary.get("minority_cluster") is None:
        table.add_row("minority accuracy", "none (no cluster smaller than the others)")
    else:
        table.add_row(f"minority (cluster {summary['minority_cluster']}) accuracy",
                      percent(summary.get("minority_accuracy")))
        table.add_row("majority accuracy", percent(summary.get("majority_accuracy")))
    one = clustering.get("n_clusters") == 1  # no pair to separate: MSS, MPO, E_c say nothing
    if one:
        table.add_row("clusters M", "1: nothing in round 1 stood out of the DP noise "
                      "(docs/algorithm.md#choice-of-m)")
    for key, label in (("n_clusters", "clusters M"), ("mss", "MSS"), ("mpo", "MPO"),
                       ("switch_round", "switch round E_c"), ("em_iterations", "EM iterations"),
                       ("ari", "ARI round 1"), ("final_ari", "ARI final"),
                       ("found_structure", "full structure found"),
                       ("minority_isolated", "minority isolated")):
        if one and key in ("n_clusters", "mss", "mpo", "switch_round", "em_iterations"):
            continue
        if clustering.get(key) is not None:
            value = clustering[key]
            table.add_row(label, f"{value:.4g}" if isinstance(value, float) else str(value))
    spent = summary.get("max_epsilon_spent")
    table.add_row("max epsilon spent", f"{spent:.4f}" if _known(spent) else "-")
    table.add_row("spent before the run", _spent_before(results))
    table.add_row("wall time", f"{results['wall_seconds']:.1f} s")
    return table


def _evaluated(summary: dict[str, Any]) -> str:
    """' (20 of 21 silos, round 30)': whose figures the means hold."""
    if summary.get("evaluated_round") is None or "silos" not in summary:
        return ""
    return (f" ({summary.get('silos_evaluated', 0)} of {summary['silos']} silos, "
            f"round {summary['evaluated_round']})")


def _spent_before(results: dict[str, Any]) -> str:
    """Each silo that joined with budget spent in earlier runs: 'silo 2: 9.38 of 10'."""
    spent = [(c["partition"], c["epsilon_spent_before_run"], c["epsilon_budget"])
             for c in results.get("clients", []) if c.get("epsilon_spent_before_run")]
    if not spent:
        return "none"
    return ", ".join(f"silo {p}: {before:.4g} of {budget:g}" for p, before, budget in spent)


def silo_table(results: dict[str, Any]) -> Table:
    """Each silo's outcome: cluster (true → final), test accuracy and its round, epsilon spent
    (in this run / before it) against the budget it claims, its noise multiplier z and batch
    b_i, its weight in its cluster's last aggregation, and the rounds it dropped out of / it
    refused. A figure older results lack is ``-``. Headers wrap at spaces: the table fits 100
    columns (each silo's balanced accuracy and AUROC are in results.json and TensorBoard;
    their means in :func:`summary_table`)."""
    table = Table(title="silos", show_header=True)
    for column in ("silo", "cluster true → final", "test acc", "round", "eps spent",
                   "eps claim", "spent before", "z", "batch", "weight", "dropped / refused"):
        # A header of several words takes the width of its longest (5 at least: 0.123), so its
        # words wrap; left alone, rich narrows the widest columns first and cuts their headers.
        table.add_column(column, justify="left" if "→" in column or "/" in column else "right",
                         max_width=max(5, *map(len, column.split())) if " " in column else None)
    for c in results["clients"]:
        table.add_row(str(c["partition"]), f"{c['true_cluster']} → {c['final_cluster']}",
                      percent(c.get("test_accuracy")) + (" stale" if c.get("stale") else ""),
                      str(c.get("evaluated_round") or "-"), _number(c.get("epsilon_spent"), 3),
                      _number(c.get("epsilon_budget"), 4, "g"),
                      _number(c.get("epsilon_spent_before_run") or 0.0, 3),
                      _number(c.get("noise_multiplier"), 3), str(c.get("batch_size") or "-"),
                      _number(c.get("aggregation_weight"), 3),
                      _lost_rounds(c.get("dropped_rounds"), c.get("refused_rounds")))
    return table


def _number(value: Any, digits: int, form: str = "f") -> str:
    return f"{value:.{digits}{form}}" if _known(value) else "-"


def _lost_rounds(dropped: list[int] | None, refused: list[int] | None) -> str:
    """'3,7 / -': the rounds a silo dropped out of / refused; none of either: empty (the
    common case stays quiet)."""
    if not dropped and not refused:
        return ""
    return " / ".join(",".join(map(str, rounds)) if rounds else "-"
                      for rounds in (dropped, refused))
