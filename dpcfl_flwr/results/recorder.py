"""The results directory of a run, written as the run goes (nothing is lost if it stops).

``progress.jsonl``  one JSON line per round (what ``dpcfl simulate`` displays live)
``rounds.csv``      the same per-round metrics as a table
``results.json``    config, per-round metrics, per-silo outcome, clustering, summary;
                    rewritten after every evaluation with ``"complete": false`` until the end
``models/``         the final cluster models (``cluster-<m>.pt``, torch state dicts)
``accuracy.png``    test accuracy per true cluster over rounds
``projection.png``  round-1 updates in the 2-D projection with the fitted GMM (Fig. 5)
"""

from __future__ import annotations

import csv
import json
import math
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord
from flwr.serverapp.strategy import Result
from sklearn.metrics import adjusted_rand_score

from ..config.settings import ExperimentConfig
from ..strategies import ClusteredStrategy, RoundReport
from ..strategies.checkpoint import CHECKPOINT, Checkpoint, save_checkpoint
from .report import plot_accuracy_by_cluster, plot_projection, write_json_atomic

CSV_FIELDS = ["round", "stage", "seconds", "server_seconds", "trained", "refused", "dropped",
              "cluster_sizes", "mean_val_accuracy", "mean_test_accuracy",
              "minority_test_accuracy", "mean_test_balanced_accuracy", "mean_test_auroc",
              "max_epsilon_spent"]


def minority_cluster(true_clusters: dict[int, int]) -> int | None:
    """The true cluster with fewer silos than every other (the paper's minority, RQ2); None
    when no cluster is smaller than all the others ({2, 2}, {2, 2, 6} or one cluster: no
    minority to report on)."""
    counts = Counter(true_clusters.values())
    smallest = min(counts.values(), default=0)
    at_smallest = [cluster for cluster, count in counts.items() if count == smallest]
    return at_smallest[0] if len(counts) > 1 and len(at_smallest) == 1 else None


def structure_found(truth: dict[int, int], assigned: dict[int, int]
                    ) -> tuple[bool, bool | None]:
    """(final partition equals the true one up to relabelling, the minority silos share a
    cluster with no majority silo: None without a minority), as
    docs/algorithm.md#evaluation-protocol counts them."""
    partitions = sorted(truth)
    exact = adjusted_rand_score([truth[p] for p in partitions],
                                [assigned[p] for p in partitions]) == 1.0
    minority = minority_cluster(truth)
    if minority is None:
        return exact, None
    members = {assigned[p] for p in partitions if truth[p] == minority}
    isolated = len(members) == 1 and not any(
        assigned[p] in members for p in partitions if truth[p] != minority)
    return exact, isolated


#: Files a run writes into its results directory from its start: any of them there means
#: that the directory is an earlier run's.
RUN_FILES = ("progress.jsonl", "rounds.csv", "results.json", CHECKPOINT)


def unused_results_directory(out: str | Path) -> Path:
    """``out`` if no run has written there, else the first of ``out-2``, ``out-3``, ... that
    no run has: a new run never rewrites an earlier run's files (a deployment's run config
    names the same out-dir every time, e.g. compose.yaml's)."""
    base, number = Path(out), 1
    candidate = base
    while any((candidate / name).exists() for name in RUN_FILES):
        number += 1
        candidate = base.with_name(f"{base.name}-{number}")
    return candidate


class RunRecorder:
    """A :class:`~dpcfl_flwr.strategies.RunObserver` that writes the results directory."""

    def __init__(self, out_dir: str | Path, experiment: ExperimentConfig,
                 resumed: Checkpoint | None = None) -> None:
        """``resumed``: the checkpoint a resumed run continues from; its rows are the
        results so far (what the files held after a later, unfinished round is dropped)."""
        self.out = Path(out_dir)
        self.experiment = experiment
        self.out.mkdir(parents=True, exist_ok=True)
        self.started = time.time() - (resumed.wall_seconds if resumed else 0.0)
        self.rounds: list[dict[str, Any]] = []
        (self.out / "progress.jsonl").write_text("")
        with (self.out / "rounds.csv").open("w", newline="") as handle:
            csv.writer(handle).writerow(CSV_FIELDS)
        self._resumed_rows = list(resumed.rows) if resumed else []

    def silos_known(self, strategy: ClusteredStrategy) -> None:
        self._event({"event": "start", "silos": len(strategy.silos),
                     "method": strategy.name, "rounds": self.experiment.num_server_rounds,
                     "resumed_after": len(self._resumed_rows)})
        for row in self._resumed_rows:  # the rounds done before, as they were reported
            self._keep_row(row)
        self._resumed_rows = []

    def round_done(self, strategy: ClusteredStrategy, report: RoundReport) -> None:
        """Append the round's row, rewrite results.json after an evaluation, and save the
        run's checkpoint (``checkpoint.pkl``): a run killed after this continues from here."""
        self._keep_row(self._round_row(strategy, report))
        if report.test_accuracy:
            write_json_atomic(self.out / "results.json", self.results(strategy, complete=False))
        checkpoint = strategy.checkpoint()
        checkpoint.rows, checkpoint.wall_seconds = list(self.rounds), time.time() - self.started
        save_checkpoint(self.out / CHECKPOINT, checkpoint)

    def _keep_row(self, row: dict[str, Any]) -> None:
        self.rounds.append(row)
        self._event({"event": "round", **row})
        with (self.out / "rounds.csv").open("a", newline="") as handle:
            csv.writer(handle).writerow(
                [";".join(map(str, v)) if isinstance(v, list) else v
                 for v in (row[k] for k in CSV_FIELDS)])

    def finish(self, strategy: ClusteredStrategy, result: Result | None = None
               ) -> dict[str, Any]:
        """Write the final models, plots and results. ``result``: what Flower's round loop
        returned (its arrays are the cluster models); without it the strategy's models.
        The complete results.json comes last: it is what marks a run finished (a comparison
        grid keeps such a cell), so a run stopped before it left nothing half-written behind
        a finished mark."""
        results = self.results(strategy, complete=True)
        arrays = result.arrays if result is not None and result.arrays is not None \
            else strategy.cluster_arrays()
        save_cluster_models(arrays, self.out / "models")
        redraw_figures(results, self.out)
        write_json_atomic(self.out / "results.json", results)
        self._event({"event": "done", "summary": results["summary"]})
        return results

    # --- pieces ---------------------------------------------------------------------------
    def _event(self, payload: dict[str, Any]) -> None:
        with (self.out / "progress.jsonl").open("a") as handle:
            handle.write(json.dumps({"time": round(time.time() - self.started, 3), **payload},
                                    default=float) + "\n")

    def _round_row(self, strategy: ClusteredStrategy, report: RoundReport) -> dict[str, Any]:
        truth = {p: s.true_cluster for p, s in strategy.silos.items()}
        minority = minority_cluster(truth)
        tested = report.test_accuracy or {}
        minority_acc = [a for p, a in tested.items() if truth[p] == minority]
        spent = [s.epsilon_spent for s in strategy.silos.values()]
        return {
            "round": report.round, "stage": report.stage, "seconds": round(report.seconds, 3),
            "server_seconds": round(report.server_seconds, 3),
            "evaluate_seconds": round(report.evaluate_seconds, 3), "trained": len(report.trained),
            "refused": report.refused, "dropped": report.dropped,
            "cluster_sizes": report.cluster_sizes(strategy.n_clusters),
            "mean_val_accuracy": _mean(report.val_accuracy.values()),
            "mean_test_accuracy": _mean(tested.values()),
            "minority_test_accuracy": _mean(minority_acc),
            "mean_test_balanced_accuracy": _mean(report.test_balanced_accuracy.values()),
            "mean_test_auroc": _mean(report.test_auroc.values()),
            "max_epsilon_spent": max(spent) if spent else None,
            "client_cpu_seconds": round(sum(report.client_cpu_seconds.values()), 3),
            "silo_cpu_seconds": {str(p): round(c, 3)
                                 for p, c in sorted(report.client_cpu_seconds.items())},
            "test_accuracy": {str(p): _finite(a) for p, a in tested.items()},
            "test_balanced_accuracy": {str(p): _finite(a) for p, a in
                                       sorted(report.test_balanced_accuracy.items())},
            "test_auroc": {str(p): _finite(a) for p, a in sorted(report.test_auroc.items())},
            "aggregation": {str(m): block for m, block in sorted(report.aggregation.items())},
        }

    def results(self, strategy: ClusteredStrategy, complete: bool) -> dict[str, Any]:
        truth = {p: s.true_cluster for p, s in strategy.silos.items()}
        final = {p: strategy.current_cluster(p) for p in strategy.silos}
        last, evaluated = last_evaluations(strategy.reports)
        clients = [
            {"partition": p, "true_cluster": s.true_cluster, "final_cluster": final[p],
             "test_accuracy": _finite(s.test_accuracy), "test_loss": _finite(s.test_loss),
             "test_balanced_accuracy": _finite(s.test_balanced_accuracy),
             "test_auroc": _finite(s.test_auroc), "majority_class": s.majority_class,
             "evaluated_round": evaluated.get(p),
             "stale": s.test_accuracy is not None and evaluated.get(p, -1) != last,
             "epsilon_spent": s.epsilon_spent, "epsilon_budget": s.epsilon_budget,
             "epsilon_spent_before_run": s.epsilon_spent_before,
             "delta": s.delta, "noise_multiplier": s.noise_multiplier,
             "batch_size": s.batch_size, "aggregation_weight": s.weight,
             "dprivacy_leakage": s.dprivacy_leakage, "learning_rate": s.learning_rate,
             "num_train": s.num_train, "dropped_rounds": s.dropped_rounds,
             "refused_rounds": s.refused_rounds, "exhausted": s.exhausted}
            for p, s in sorted(strategy.silos.items())
        ]
        return {
            "complete": complete, "method": strategy.name,
            "wall_seconds": round(time.time() - self.started, 2),
            "config": self.experiment.to_run_config(),
            "rounds": self.rounds, "clients": clients,
            # the rate every silo trains at once it has chosen (None: the run set one)
            "learning_rate": strategy.federation_learning_rate(),
            "clustering": self._clustering(strategy, truth, final),
            "summary": summarise(clients, truth, last),
        }

    def _clustering(self, strategy: ClusteredStrategy, truth: dict[int, int],
                    final: dict[int, int]) -> dict[str, Any]:
        """The run's clustering, scored against the true groups only where every silo's is
        known (a silo on its own records without a ``true-cluster`` says -1: an ARI against
        that would read as "no structure found" where the groups are simply unknown)."""
        block: dict[str, Any] = {"n_clusters": strategy.n_clusters}
        truth = truth if all(cluster >= 0 for cluster in truth.values()) else {}
        if truth and strategy.discovers_clusters:
            exact, isolated = structure_found(truth, final)
            block.update({"final_ari": adjusted_rand_score(
                [truth[p] for p in sorted(truth)], [final[p] for p in sorted(truth)]),
                "found_structure": exact, "minority_isolated": isolated})
        block.update(strategy.method.results())
        if "labels" in block and truth:  # the method's own clustering of round-1 updates
            block["ari"] = adjusted_rand_score(
                [truth[p] for p in block["partitions"]], block["labels"])
        return block

def save_cluster_models(arrays: ArrayRecord, folder: Path) -> list[Path]:
    """``cluster-<m>.pt`` (a torch state dict) per cluster model of ``arrays``, whose keys are
    ``cluster-<m>.<tensor name>`` (:meth:`ClusteredStrategy.cluster_arrays`)."""
    folder.mkdir(parents=True, exist_ok=True)
    states: dict[str, dict[str, torch.Tensor]] = {}
    for key, array in arrays.items():
        cluster, _, tensor = key.partition(".")
        states.setdefault(cluster, {})[tensor] = torch.from_numpy(array.numpy().copy())
    paths = []
    for cluster, state in states.items():
        paths.append(folder / f"{cluster}.pt")
        torch.save(state, paths[-1])
    return paths


def redraw_figures(results: dict[str, Any], out: Path) -> list[Path]:
    """accuracy.png and (for R-DPCFL) projection.png, from a results.json alone."""
    truth = {c["partition"]: c["true_cluster"] for c in results["clients"]}
    figures = [plot_accuracy_by_cluster(results["rounds"], truth, out / "accuracy.png",
                                        f"{results['method']}: test accuracy per true cluster")]
    clustering = results["clustering"]
    if "points" in clustering:
        figures.append(plot_projection(
            np.asarray(clustering["points"]), [truth[p] for p in clustering["partitions"]],
            np.asarray(clustering["means"]), np.asarray(clustering["radii"]),
            out / "projection.png",
            f"round-1 updates: M={clustering['n_clusters']}, MSS={clustering['mss']:.2f}"
            + (f", ARI={clustering['ari']:.2f}" if "ari" in clustering else "")))
    return figures


def last_evaluations(reports: list[RoundReport]) -> tuple[int | None, dict[int, int]]:
    """The run's last evaluated round (None before any), and the last round each silo's
    evaluation reply was used in."""
    last, evaluated = None, {}
    for report in reports:
        if report.test_accuracy is not None:
            last = report.round
            evaluated.update(dict.fromkeys(report.test_accuracy, report.round))
    return last, evaluated


def summarise(clients: list[dict[str, Any]], truth: dict[int, int],
              evaluated_round: int | None) -> dict[str, Any]:
    """Mean test accuracy over all silos, the minority silos and the majority silos, and the
    mean balanced accuracy and AUROC (two classes) over all silos, each over the silos
    evaluated in the last evaluation (``evaluated_round``) only: a silo that dropped out keeps
    an earlier round's figure, which is stale and named in ``stale_silos``."""
    if not truth:
        return {}
    minority = minority_cluster(truth)
    current = [c for c in clients if not c.get("stale")]
    accuracy = {c["partition"]: c["test_accuracy"] for c in current
                if c["test_accuracy"] is not None}
    return {
        "mean_accuracy": _mean(accuracy.values()),
        "mean_balanced_accuracy": _mean(c.get("test_balanced_accuracy") for c in current
                                        if c["partition"] in accuracy),
        "mean_auroc": _mean(c.get("test_auroc") for c in current
                            if c["partition"] in accuracy),
        "minority_accuracy": None if minority is None else _mean(
            a for p, a in accuracy.items() if truth[p] == minority),
        "majority_accuracy": None if minority is None else _mean(
            a for p, a in accuracy.items() if truth[p] != minority),
        "minority_cluster": minority,
        "max_epsilon_spent": max(c["epsilon_spent"] for c in clients),
        "silos": len(clients),
        "silos_evaluated": len(accuracy),
        "evaluated_round": evaluated_round,
        "stale_silos": {str(c["partition"]): c["evaluated_round"] for c in clients
                        if c.get("stale")},
        "spent_before_run": {str(c["partition"]): c["epsilon_spent_before_run"]
                             for c in clients if c.get("epsilon_spent_before_run")},
    }


def _mean(values: Any) -> float | None:
    """The mean of the known values; None when none is known (private metrics, no replies)."""
    values = [v for v in (_finite(v) for v in values) if v is not None]
    return float(np.mean(values)) if values else None


def _finite(value: Any) -> float | None:
    """A reported number, or None when it is unknown (absent, NaN): JSON has no NaN."""
    if value is None or not math.isfinite(float(value)):
        return None
    return float(value)
