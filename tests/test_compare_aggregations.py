"""`dpcfl compare --aggregations`: the (method, rule) grid, its refusals, and the tables'
aggregated noise level, read from results.json files written the way runs write them; and
`dpcfl report`'s per-silo table on new and old results."""

from __future__ import annotations

import csv
import json
from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner

from dpcfl_flwr.cli import app
from dpcfl_flwr.config.settings import ConfigError
from dpcfl_flwr.runs import compare
from dpcfl_flwr.runs.compare import (
    GridRun,
    apply_overrides,
    plan_grid,
    run_config,
    run_grid,
    variants,
)
from dpcfl_flwr.runs.compare_report import (
    collect,
    mean_noise_level,
    mean_oracle_ratio,
    write_reports,
)
from dpcfl_flwr.runs.progress import silo_table

CLIP = 3.0
#: Six silos in two true clusters with budgets of the paper's kind of spread (dist2-like): the
#: smaller budget, the larger noise multiplier z_i; batch sizes differ per silo.
SILOS = [  # (partition, cluster, budget, z, batch)
    (0, 0, 1.0, 2.9, 32), (1, 0, 2.0, 1.7, 64), (2, 0, 5.0, 0.9, 32),
    (3, 1, 1.0, 2.9, 32), (4, 1, 5.0, 0.9, 128), (5, 1, 10.0, 0.6, 64)]


def variance(z: float, batch: int) -> float:
    """sigma_i^2 per coordinate of a silo's averaged DP-SGD step at learning rate 1."""
    return (z * CLIP / batch) ** 2


def aggregation(rule: str) -> dict[str, Any]:
    """One round's per-cluster record: the rule's weights, its noise level sum w_i^2 sigma_i^2
    and the oracle's (weights proportional to 1 / sigma_i^2)."""
    block = {}
    for cluster in (0, 1):
        members = [(p, variance(z, b)) for p, c, _, z, b in SILOS if c == cluster]
        inverse = {p: 1 / v for p, v in members}
        oracle = {p: w / sum(inverse.values()) for p, w in inverse.items()}
        weights = oracle if rule == "oracle-variance" else (
            {p: 1 / len(members) for p, _ in members} if rule == "uniform"
            # Robust-HDP estimates the variances: close to the oracle, not equal to it
            else {p: 0.9 * w + 0.1 / len(members) for p, w in oracle.items()})
        level = sum(weights[p] ** 2 * v for p, v in members)
        block[str(cluster)] = {
            "weights": {str(p): w for p, w in weights.items()},
            "estimated_variance": {str(p): 1.1 * v for p, v in members}
            if rule == "robust-hdp" else None,
            "noise_level": level, "oracle_noise_level": 1 / sum(inverse.values()),
            "fallback": None}
    return block


def results_file(run: GridRun, accuracy: float, rule: str | None = None) -> dict[str, Any]:
    """A finished run's results.json in ``run.directory``; ``rule`` None: written before the
    aggregation records and the silos' new fields existed."""
    rounds = [{"round": r, "stage": "train", "cluster_sizes": [3, 3], "trained": 6,
               "refused": [], "dropped": [], "max_epsilon_spent": 0.2 * r,
               "test_accuracy": {}, **({"aggregation": aggregation(rule)} if rule else {})}
              for r in (1, 2, 3)]
    clients = []
    for p, cluster, budget, z, batch in SILOS:
        client = {"partition": p, "true_cluster": cluster, "final_cluster": cluster,
                  "test_accuracy": accuracy, "test_loss": 1.0, "evaluated_round": 3,
                  "stale": False, "epsilon_spent": 0.6 * budget, "epsilon_budget": budget,
                  "epsilon_spent_before_run": 0.0, "delta": 1e-4, "noise_multiplier": z,
                  "num_train": 500, "dropped_rounds": [], "refused_rounds": [],
                  "exhausted": False}
        if rule:
            client.update(batch_size=batch, aggregation_weight=float(
                rounds[-1]["aggregation"][str(cluster)]["weights"][str(p)]))
        clients.append(client)
    results = {
        "complete": True, "method": run.method, "wall_seconds": 12.5,
        "config": {"method": run.method, "epsilon": run.epsilon, "seed": run.seed,
                   "out-dir": str(run.directory), **({"aggregation": rule} if rule else {})},
        "rounds": rounds, "clients": clients,
        "clustering": {"n_clusters": 2},
        "summary": {"mean_accuracy": accuracy, "minority_accuracy": None,
                    "majority_accuracy": None, "minority_cluster": None,
                    "max_epsilon_spent": 6.0, "silos": 6, "silos_evaluated": 6,
                    "evaluated_round": 3, "stale_silos": {}, "spent_before_run": {}}}
    run.directory.mkdir(parents=True, exist_ok=True)
    (run.directory / "results.json").write_text(json.dumps(results))
    return results


def test_the_axis_gives_each_method_and_rule_its_own_row_and_directory(tmp_path):
    out = tmp_path / "out"
    runs = plan_grid(["global", "ifca"], [5], [0, 1], out, ["uniform", "robust-hdp"])
    assert len(runs) == 8
    assert {r.directory for r in runs if r.seed == 0} == {
        out / f"{m}-{r}" / "eps5" / "seed0"
        for m in ("global", "ifca") for r in ("uniform", "robust-hdp")}
    robust = next(r for r in runs if r.variant == "global/robust-hdp")
    assert robust.label == "global/robust-hdp eps=5 seed=0"
    # the axis wins over the config file's own rule
    assert run_config(robust, {"aggregation": "samples"}, {})["aggregation"] == "robust-hdp"
    assert variants(["global", "ifca"], ["uniform", "robust-hdp"]) == [
        "global/uniform", "global/robust-hdp", "ifca/uniform", "ifca/robust-hdp"]
    # no axis: today's layout, and the config's rule
    plain = plan_grid(["global"], [5], [0], out)[0]
    assert plain.directory == out / "global" / "eps5" / "seed0" and plain.variant == "global"
    assert run_config(plain, {"aggregation": "samples"}, {})["aggregation"] == "samples"


def test_set_cannot_change_the_rule_on_an_aggregation_axis():
    assert apply_overrides({}, {}, {"aggregation": "samples"})[0] == {"aggregation": "samples"}
    with pytest.raises(ConfigError, match="--set cannot change aggregation: .*--aggregations"):
        apply_overrides({}, {}, {"aggregation": "samples"}, axis=True)


def test_a_rule_a_method_cannot_take_fails_before_any_run(tmp_path, monkeypatch):
    monkeypatch.setattr(compare, "execute", lambda *_: pytest.fail("a run started"))
    runs = plan_grid(["global", "local"], [5], [0], tmp_path, ["robust-hdp"])
    with pytest.raises(ConfigError, match="method local combines its updates its own way"):
        run_config(runs[1], {}, {})
    lines: list[str] = []
    with pytest.raises(ConfigError) as refused:
        run_grid(runs, {}, {}, report=lines.append)
    assert "\n" not in str(refused.value) and not lines
    assert not any(tmp_path.iterdir())
    with pytest.raises(ConfigError, match="not an aggregation rule"):
        run_config(plan_grid(["global"], [5], [0], tmp_path, ["median"])[0], {}, {})


def test_noise_level_of_a_run_is_the_mean_over_rounds_and_clusters(tmp_path):
    run = GridRun("global", 5.0, 0, tmp_path / "run", "uniform")
    uniform = results_file(run, 0.6, "uniform")
    levels = [block["noise_level"] for block in aggregation("uniform").values()]
    assert mean_noise_level(uniform) == pytest.approx(sum(levels) / 2)
    assert mean_oracle_ratio(uniform) > 1.0
    oracle = results_file(run, 0.6, "oracle-variance")
    assert mean_oracle_ratio(oracle) == pytest.approx(1.0)
    # a cluster that fell back without a level, and results from before the records: none
    uniform["rounds"][0]["aggregation"]["0"].update(noise_level=None, fallback="samples")
    assert mean_noise_level(uniform) == pytest.approx((2 * levels[0] + 3 * levels[1]) / 5)
    old = results_file(run, 0.6)
    assert mean_noise_level(old) is None and mean_oracle_ratio(old) is None


def test_tables_show_the_noise_level_per_rule_and_dashes_for_old_results(tmp_path):
    out = tmp_path / "out"
    runs = plan_grid(["global"], [5], [0, 1], out, ["uniform", "robust-hdp"])
    for run in runs:
        results_file(run, 0.60 + 0.02 * run.seed, run.rule)
    old = GridRun("global", 5.0, 0, out / "global-samples" / "eps5" / "seed0", "samples")
    results_file(old, 0.55)  # a run from before the aggregation records
    rows = variants(["global"], ["uniform", "robust-hdp", "samples"])
    table = write_reports(collect([*runs, old]), rows, [5.0], out)

    assert table == (out / "summary.md").read_text()
    assert "| method/aggregation | eps=5 |" in table
    assert "| global/uniform | 61.0 ± 1.0 |" in table
    noise = table.split("**Aggregated noise level")[1].split("\n\n**")[0]
    level = mean_noise_level(results_file(runs[0], 0.6, "uniform"))
    assert f"| global/uniform | {level:.2e} ± 0.0e+00 |" in noise
    assert "| global/samples | - |" in noise
    ratio = table.split("**Noise level relative to the oracle's**")[1]
    robust = mean_oracle_ratio(results_file(runs[1], 0.6, "robust-hdp"))
    assert f"| global/robust-hdp | {robust:.2f} ± 0.00 |" in ratio
    assert "| global/samples | - |" in ratio

    with (out / "summary.csv").open() as handle:
        reader = csv.reader(handle)
        header = next(reader)
        by_rule = {row[header.index("aggregation")]: dict(zip(header, row, strict=True))
                   for row in reader}
    assert header[:11] == ["method", "epsilon", "seeds", "accuracy_mean", "accuracy_std",
                           "minority_mean", "minority_std", "found_structure",
                           "minority_isolated", "max_noise_multiplier", "max_epsilon_spent"]
    assert header[11:] == ["aggregation", "noise_level_mean", "noise_level_std",
                           "noise_vs_oracle_mean", "noise_vs_oracle_std",
                           "balanced_accuracy_mean", "balanced_accuracy_std", "auroc_mean",
                           "auroc_std"]
    assert float(by_rule["uniform"]["noise_level_mean"]) == pytest.approx(level)
    assert float(by_rule["uniform"]["noise_vs_oracle_mean"]) > float(
        by_rule["robust-hdp"]["noise_vs_oracle_mean"]) > 1.0
    assert by_rule["samples"]["method"] == "global" and by_rule["samples"]["seeds"] == "1"
    assert by_rule["samples"]["noise_level_mean"] == by_rule["samples"]["noise_vs_oracle_std"] == ""


def test_a_grid_without_the_axis_keeps_todays_tables(tmp_path):
    out = tmp_path / "out"
    runs = plan_grid(["global"], [5], [0], out)
    results_file(runs[0], 0.6)
    table = write_reports(collect(runs), variants(["global"], None), [5.0], out)
    assert "| method | eps=5 |" in table and "| global | 60.0 ± 0.0 |" in table
    assert "noise level" not in table.lower()


def rendered(results: dict[str, Any], width: int = 100) -> list[str]:
    console = Console(width=width, record=True, color_system=None)
    console.print(silo_table(results))
    return console.export_text().splitlines()


def silo_row(lines: list[str], partition: int) -> list[str]:
    """The cells of silo ``partition``'s row of a rendered silo table."""
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in lines
            if line.startswith("│")]
    return next(row for row in rows if row[0] == str(partition))


def test_silo_table_shows_budget_batch_noise_and_weight_in_100_columns(tmp_path):
    results = results_file(GridRun("global", 5.0, 0, tmp_path, "robust-hdp"), 0.6,
                           "robust-hdp")
    lines = rendered(results)
    assert max(map(len, lines)) <= 100 and "…" not in "".join(lines)
    text = "\n".join(lines)
    for header in ("eps", "claim", "z", "batch", "weight", "dropped"):
        assert header in text
    weight = results["clients"][4]["aggregation_weight"]
    cells = silo_row(lines, 4)
    assert cells == ["4", "1 → 1", "60.0%", "3", "3.000", "5", "0.000", "0.900", "128",
                     f"{weight:.3f}", ""]


def test_report_on_an_old_results_directory_shows_dashes(tmp_path):
    results_file(GridRun("global", 5.0, 0, tmp_path), 0.6)
    old = json.loads((tmp_path / "results.json").read_text())
    assert silo_row(rendered(old), 2)[7:10] == ["0.900", "-", "-"]
    shown = CliRunner().invoke(app, ["report", str(tmp_path), "--no-plots"])
    assert shown.exit_code == 0, shown.output
    assert "silos" in shown.output and "60.0%" in shown.output
