"""Every shipped example config is a valid run config (for every method it names)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dpcfl_flwr.config import registry
from dpcfl_flwr.config.config_file import flat_keys
from dpcfl_flwr.config.settings import parse_run_config
from dpcfl_flwr.runs.compare import load_grid_config

EXAMPLES = sorted((Path(__file__).parents[1] / "examples").glob("*.toml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_config_is_valid_for_every_method(path):
    base, per_method = load_grid_config(path)
    for method in registry.method_names():
        config = {**base, **per_method.get(method, {}), "method": method}
        parse_run_config(config)


def test_the_four_paper_settings_exist_at_both_scales():
    names = {p.name for p in EXAMPLES}
    for setting in ("mnist", "fmnist", "cifar10-rotation", "cifar10-labelflip"):
        assert {f"{setting}-cpu.toml", f"{setting}-paper.toml"} <= names


def test_the_apps_run_config_declares_every_key_with_its_default():
    """`flwr run` refuses a run-config key the app's pyproject.toml does not declare, so every
    key of the run config stands there, with the value the code defaults to."""
    import tomllib

    from dpcfl_flwr.config.settings import ExperimentConfig

    pyproject = Path(__file__).parents[1] / "pyproject.toml"
    declared = tomllib.loads(pyproject.read_text())["tool"]["flwr"]["app"]["config"]
    assert flat_keys(declared) == ExperimentConfig().to_run_config()
