"""Models chosen by the federation: the registry's names and typed parameters, the table MLP,
installed plug-ins (entry points), Opacus' refusal or fix, a pretrained start and frozen
layers, each failure one line; and a silo that cannot build the run's model refuses its
messages with the reason."""

from __future__ import annotations

import logging
import math
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from opacus.validators import ModuleValidator
from torch import nn

from dpcfl_flwr.config.settings import ExperimentConfig, parse_run_config
from dpcfl_flwr.config.validation import ConfigError
from dpcfl_flwr.dpsgd.per_sample import engine_name, layerwise_supported
from dpcfl_flwr.models import ModelSpec, build, count_parameters, initial_state, model_names
from dpcfl_flwr.protocol import SILO_FAILED
from dpcfl_flwr.server_app import initial_arrays
from tests.test_malicious_server import Attacker, _refused, _run_config


def _error(raw: dict) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_run_config(raw)
    text = str(caught.value)
    assert "\n" not in text
    return text


# --- names and parameters ------------------------------------------------------------------
def test_the_built_ins_are_registered():
    assert model_names()[:3] == ("cnn", "resnet18", "mlp")


@pytest.mark.parametrize(("raw", "expected"), [
    ({"model": "vgg"}, "run config: 'model' = 'vgg' is invalid: not an installed model; choose "
     "from cnn, resnet18, mlp"),
    ({"model": "mlp", "input-shape": "14", "model-params.depth": 3},
     "run config: model 'mlp' has no parameter 'model-params.depth' (its parameters: "
     "model-params.hidden)"),
    ({"model": "mlp", "input-shape": "14", "model-params.hidden": "64,x"},
     "run config: model 'mlp': 'model-params.hidden' = '64,x' is invalid: '64,x' is not a "
     "comma-separated list of integers"),
    ({"model": "mlp", "input-shape": "14", "model-params.hidden": "64,0"},
     "every width must be a positive integer"),
    ({"model": "cnn", "model-params.channels": "8"},
     "the CNN has two conv blocks: give two widths"),
    ({"model": "resnet18", "model-params.groups": 3}, "'model-params.groups' = 3 is invalid: "
     "must divide 64"),
    ({"model": "cnn", "model-params.hidden": 8}, "model 'cnn' has no parameter "
     "'model-params.hidden' (its parameters: model-params.channels)"),
])
def test_a_bad_model_or_parameter_is_one_line(raw, expected):
    assert expected in _error(raw)


def test_parameters_travel_in_the_run_config_and_back():
    experiment = parse_run_config({"model": "mlp", "input-shape": "14",
                                   "model-params.hidden": "32,16", "trainable": "classifier"})
    assert experiment.model_params.hidden == (32, 16)
    flat = experiment.to_run_config()
    assert flat["model-params.hidden"] == "32,16"  # a run config holds no lists
    assert parse_run_config(flat) == experiment
    # defaults are not written: the app's pyproject declares no model's table
    assert not [key for key in ExperimentConfig().to_run_config() if key.startswith("model-p")]
    assert experiment.model_spec == ModelSpec("mlp", 10, (14,), (("hidden", "32,16"),), False,
                                              ("classifier",))


# --- the MLP ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("shape", "hidden", "expected"), [
    ((14,), "32,16", 14 * 32 + 32 + 32 * 16 + 16 + 16 * 3 + 3),  # 1,059
    ((2, 7), "32,16", 1_059),  # the record is flattened: 14 features either way
    ((14,), "", 14 * 3 + 3),  # no hidden layer: logistic regression
    ((5,), "8", 5 * 8 + 8 + 8 * 3 + 3),
])
def test_mlp_shapes_and_parameter_count(shape, hidden, expected):
    model = build(ModelSpec("mlp", 3, shape, (("hidden", hidden),)))
    assert count_parameters(model) == expected
    assert model(torch.randn(4, *shape)).shape == (4, 3)
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert ModuleValidator.validate(model) == []
    assert layerwise_supported(model) and engine_name(model, "auto") == "layerwise"


def test_the_default_mlp_and_the_cnn_with_other_widths_and_sizes():
    mlp = build(ModelSpec("mlp", 10, (14,)))
    assert [m.out_features for m in mlp.modules() if isinstance(m, nn.Linear)] == [64, 64, 10]
    cnn = build(ModelSpec("cnn", 10, (1, 12, 12), (("channels", "8,16"),)))
    # conv 1x8x5x5 + 8, conv 8x16x5x5 + 16, linear 16 x 3 x 3 -> 10
    assert count_parameters(cnn) == (8 * 25 + 8) + (8 * 16 * 25 + 16) + (16 * 9 * 10 + 10)
    assert cnn(torch.randn(2, 1, 12, 12)).shape == (2, 10)


def test_a_model_that_cannot_take_the_schemas_shape_is_one_line():
    with pytest.raises(ConfigError, match=r"model 'cnn' \(built-in\) could not be built for 10 "
                       r"classes and input shape \(14,\): ValueError: the CNN needs records"):
        build(ModelSpec("cnn", 10, (14,)))


# --- plug-ins through the entry point group ------------------------------------------------
PLUGIN = '''
import math

from pydantic import BaseModel
from torch import nn


class Params(BaseModel):
    width: int = 8


def build(num_classes: int, input_shape: tuple[int, ...], params: Params) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), params.width),
                         nn.ReLU(), nn.Linear(params.width, num_classes))


def plain(num_classes, input_shape):
    return nn.Linear(math.prod(input_shape), num_classes)


def broken(num_classes: int, input_shape: tuple[int, ...], params: Params) -> nn.Module:
    raise RuntimeError("needs a GPU\\nsecond line")


def batch_normed(num_classes: int, input_shape: tuple[int, ...], params: Params) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), params.width),
                         nn.BatchNorm1d(params.width), nn.ReLU(),
                         nn.Linear(params.width, num_classes))


def not_a_module(num_classes: int, input_shape: tuple[int, ...], params: Params) -> str:
    return "a string"


class FailsOnBatches(nn.Module):
    def __init__(self, inputs: int, num_classes: int) -> None:
        super().__init__()
        self.linear = nn.Linear(inputs, num_classes)

    def forward(self, x):
        if x.shape[0] > 1:
            raise RuntimeError("kernel failed")
        return self.linear(x.flatten(1))


def fails_in_training(num_classes: int, input_shape: tuple[int, ...], params: Params):
    return FailsOnBatches(math.prod(input_shape), num_classes)


def instance_normed(num_classes: int, input_shape: tuple[int, ...], params: Params):
    norm = nn.InstanceNorm2d(4, affine=True, track_running_stats=True)
    return nn.Sequential(nn.Conv2d(input_shape[0], 4, 3), norm, nn.Flatten(),
                         nn.Linear(4 * 26 * 26, num_classes))
'''

ENTRY_POINTS = """
[dpcfl_flwr.models]
toy-net = toyplug:build
toy-plain = toyplug:plain
toy-broken = toyplug:broken
toy-bn = toyplug:batch_normed
toy-string = toyplug:not_a_module
toy-missing = toyplug_absent:build
toy-fails = toyplug:fails_in_training
toy-in = toyplug:instance_normed
"""


@pytest.fixture()
def plugin(tmp_path, monkeypatch) -> Path:
    """A package installed the way pip leaves it: its module and a .dist-info with
    entry_points.txt, in a directory on sys.path (importlib.metadata finds it there)."""
    site = tmp_path / "site"
    (site / "toyplug-0.1.dist-info").mkdir(parents=True)
    (site / "toyplug.py").write_text(textwrap.dedent(PLUGIN))
    (site / "toyplug-0.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: toyplug\nVersion: 0.1\n")
    (site / "toyplug-0.1.dist-info" / "entry_points.txt").write_text(ENTRY_POINTS)
    monkeypatch.syspath_prepend(str(site))
    return site


def test_an_installed_plugin_builds_with_its_own_parameters(plugin):
    assert {"toy-net", "toy-plain"} <= set(model_names())
    experiment = parse_run_config({"model": "toy-net", "input-shape": "6", "num-classes": 3,
                                   "model-params.width": 5})
    model = build(experiment.model_spec, seed=0)
    assert count_parameters(model) == 6 * 5 + 5 + 5 * 3 + 3
    assert model(torch.randn(2, 6)).shape == (2, 3)
    assert parse_run_config(experiment.to_run_config()) == experiment
    # a builder without a parameter argument takes none
    assert "model 'toy-plain' has no parameter 'model-params.width' (its parameters: none)" in \
        _error({"model": "toy-plain", "model-params.width": 5})
    assert "model-params.width' = 'wide' is invalid" in _error(
        {"model": "toy-net", "model-params.width": "wide"})


@pytest.mark.parametrize(("name", "expected"), [
    ("toy-broken", "model 'toy-broken' (entry point toy-broken = toyplug:broken) could not be "
     "built for 10 classes and input shape (6,): RuntimeError: needs a GPU"),
    ("toy-string", "model 'toy-string' (entry point toy-string = toyplug:not_a_module): its "
     "builder returned a str, not a torch.nn.Module"),
])
def test_a_plugin_that_fails_to_build_is_one_line(plugin, name, expected):
    experiment = parse_run_config({"model": name, "input-shape": "6"})
    with pytest.raises(ConfigError) as caught:
        build(experiment.model_spec)
    assert str(caught.value) == expected


def test_a_plugin_that_does_not_import_is_one_line(plugin):
    expected = ("run config: model 'toy-missing' (entry point toy-missing = "
                "toyplug_absent:build) cannot be loaded: ModuleNotFoundError: No module named "
                "'toyplug_absent'")
    assert _error({"model": "toy-missing"}) == expected


@pytest.mark.parametrize(("model", "words"), [
    ("not-installed-here", "not an installed model"),
    ("toy-broken", "RuntimeError: needs a GPU"),
])
def test_a_silo_that_cannot_build_the_runs_model_refuses_with_the_reason(
        tmp_path, server_task_identity, plugin, model, words):
    attacker = Attacker(tmp_path)
    attacker.context.run_config = {**attacker.context.run_config, "model": model}
    replies = [attacker.train(1, cluster=-2)]
    if model == "not-installed-here":  # the run config itself is refused, at every message
        replies.append(attacker.query())
    for reply in replies:
        _refused(reply, SILO_FAILED, words)
        assert "\n" not in reply.error.reason
    assert not attacker.ledger_path.exists() or not attacker.ledger().entries


@pytest.mark.parametrize("run", [{"model": "toy-fails"}, {"model": "toy-in", "model-fix": True}])
def test_whatever_a_plugin_raises_is_answered_with_nothing_released_or_charged(
        tmp_path, server_task_identity, plugin, caplog, run):
    attacker = Attacker(tmp_path, run=_run_config(tmp_path, **run))
    for reply in (attacker.train(1, cluster=-2), attacker.evaluate(1)):
        _refused(reply, SILO_FAILED, "the silo failed on this message")
        assert not reply.has_content()  # nothing released
    assert "RuntimeError" in caplog.text  # the operator's log has the traceback
    assert not attacker.ledger_path.exists() or not attacker.ledger().entries


# --- what Opacus refuses, and its fix -------------------------------------------------------
def test_batchnorm_is_refused_naming_the_layer(plugin):
    with pytest.raises(ConfigError) as caught:
        build(parse_run_config({"model": "toy-bn", "input-shape": "6"}).model_spec)
    assert str(caught.value) == (
        "model 'toy-bn' cannot be trained with DP-SGD: Opacus refuses 2 (BatchNorm1d); set "
        "model-fix = true to let Opacus replace them (BatchNorm becomes GroupNorm)")


def test_a_frozen_batchnorm_is_refused_too(plugin):
    """Frozen, it still normalises each record with its batch's statistics."""
    spec = parse_run_config({"model": "toy-bn", "input-shape": "6", "trainable": "3"}).model_spec
    with pytest.raises(ConfigError, match=r"refuses 2 \(BatchNorm1d\)"):
        build(spec)


def test_the_layers_that_skip_opacus_check_are_ones_it_never_validates():
    """A model of these layers (no buffers) is not handed to Opacus' validator, to spare every
    silo process the import: sound only while Opacus registers no validator for them."""
    from dpcfl_flwr.models.dp_check import _PLAIN, needs_opacus_check

    assert not set(ModuleValidator.VALIDATORS) & set(_PLAIN)
    assert not needs_opacus_check(build(ModelSpec("mlp", 3, (6,))))
    assert needs_opacus_check(nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4)))
    assert needs_opacus_check(nn.LSTM(4, 4))


def test_model_fix_converts_the_same_way_on_server_and_silo(plugin, caplog):
    experiment = parse_run_config({"model": "toy-bn", "input-shape": "6", "model-fix": True})
    with caplog.at_level(logging.INFO, logger="dpcfl_flwr.models.dp_check"):
        server = build(experiment.model_spec, seed=4)
    assert "model toy-bn: Opacus replaced 2 (BatchNorm1d) (model-fix = true)" in caplog.text
    silo = build(experiment.model_spec)
    assert isinstance(server[2], nn.GroupNorm) and ModuleValidator.validate(server) == []
    assert not list(server.buffers())  # no running statistics left to leak
    silo.load_state_dict(server.state_dict())  # the same tensors, names and shapes
    x = torch.randn(5, 6)
    torch.testing.assert_close(silo(x), server(x))


# --- a pretrained start ---------------------------------------------------------------------
def _mlp_run(**extra) -> ExperimentConfig:
    return parse_run_config({"model": "mlp", "input-shape": "6", "num-classes": 3,
                             "model-params.hidden": "4", **extra})


@pytest.mark.parametrize("suffix", [".pt", ".npz"])
def test_initial_weights_replace_the_seeded_start(tmp_path, suffix):
    trained = {k: torch.full_like(v, 0.25) for k, v in
               build(_mlp_run().model_spec).state_dict().items()}
    path = tmp_path / f"start{suffix}"
    if suffix == ".pt":
        torch.save(trained, path)
    else:
        np.savez(path, **{k: v.numpy().astype(np.float64) for k, v in trained.items()})
    record = initial_arrays(_mlp_run(**{"initial-weights": str(path)}))
    state = record.to_torch_state_dict()
    assert list(state) == list(trained)
    for name, tensor in state.items():
        assert tensor.dtype == torch.float32
        torch.testing.assert_close(tensor, trained[name])


@pytest.mark.parametrize(("change", "words"), [
    (lambda s: s.pop("classifier.bias"), "its tensors are not the model's (missing "
     "['classifier.bias'], unexpected none)"),
    (lambda s: s.update(extra=torch.zeros(1)), "unexpected ['extra']"),
    (lambda s: s.update({"classifier.weight": torch.zeros(3, 5)}),
     "tensor 'classifier.weight' has shape (3, 5), the model's is (3, 4)"),
    (lambda s: s.update({"hidden.0.bias": torch.full((4,), math.nan)}),
     "tensor 'hidden.0.bias' has non-finite values"),
])
def test_initial_weights_that_are_not_the_models_are_one_line(tmp_path, change, words):
    state = dict(build(_mlp_run().model_spec).state_dict())
    change(state)
    torch.save(state, tmp_path / "w.pt")
    with pytest.raises(ConfigError) as caught:
        initial_state(_mlp_run().model_spec, 0, str(tmp_path / "w.pt"))
    assert str(caught.value).startswith(f"run config: initial-weights '{tmp_path / 'w.pt'}': ")
    assert words in str(caught.value) and "\n" not in str(caught.value)


def test_an_unreadable_weights_file_is_one_line(tmp_path):
    (tmp_path / "w.pt").write_bytes(b"not a checkpoint")
    for path, words in ((tmp_path / "w.pt", "cannot be read"),
                        (tmp_path / "missing.npz", "No such file"),
                        (tmp_path / "w.txt", "expected a .pt / .pth state dict or an .npz")):
        with pytest.raises(ConfigError, match="initial-weights") as caught:
            initial_state(_mlp_run().model_spec, 0, str(path))
        assert words in str(caught.value) and "\n" not in str(caught.value)


# --- frozen layers ---------------------------------------------------------------------------
def test_trainable_prefixes_freeze_the_rest():
    model = build(_mlp_run(**{"model-params.hidden": "4,4", "trainable": "hidden.2, classifier"}
                           ).model_spec)
    trained = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trained == ["hidden.2.weight", "hidden.2.bias", "classifier.weight",
                       "classifier.bias"]
    assert count_parameters(model) == 4 * 4 + 4 + 4 * 3 + 3


def test_a_prefix_matching_no_parameter_is_one_line():
    with pytest.raises(ConfigError) as caught:
        build(_mlp_run(trainable="clasifier").model_spec)
    assert str(caught.value) == ("run config: trainable = 'clasifier': 'clasifier' matches no "
                                 "parameter of model 'mlp' (its top-level modules: classifier, "
                                 "hidden)")
    with pytest.raises(ConfigError, match="'hidden.0.w' matches no parameter"):
        build(_mlp_run(trainable="hidden.0.w").model_spec)  # prefixes end at a dot


def test_the_docs_plugin_example_installs_and_builds_as_written(tmp_path, monkeypatch):
    """docs/own-data.md's plug-in: its module and its pyproject entry point, installed as pip
    would leave them, give the model the page's run config names."""
    import re
    import tomllib

    page = (Path(__file__).parents[1] / "docs" / "own-data.md").read_text()
    code = next(block for block in re.findall(r"```python\n(.*?)```", page, flags=re.S)
                if "# clinic_nets/models.py" in block)
    declared = next(block for block in re.findall(r"```toml\n(.*?)```", page, flags=re.S)
                    if "dpcfl_flwr.models" in block)
    points = tomllib.loads(declared)["project"]["entry-points"]["dpcfl_flwr.models"]
    site = tmp_path / "site"
    (site / "clinic_nets").mkdir(parents=True)
    (site / "clinic_nets" / "__init__.py").write_text("")
    (site / "clinic_nets" / "models.py").write_text(code)
    info = site / "clinic_nets-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: clinic-nets\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[dpcfl_flwr.models]\n" + "".join(f"{k} = {v}\n" for k, v in points.items()))
    monkeypatch.syspath_prepend(str(site))
    experiment = parse_run_config({"model": "deep-mlp", "input-shape": "14", "num-classes": 2,
                                   "model-params.width": 64})
    model = build(experiment.model_spec, seed=0)
    # 3 layers of 64 (the default depth) on 14 features, then 2 logits
    assert count_parameters(model) == (14 * 64 + 64) + 2 * (64 * 64 + 64) + (64 * 2 + 2)
    assert engine_name(model, "auto") == "layerwise"
