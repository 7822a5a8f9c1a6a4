"""Typed run config (the experiment, from the server) and node config (the silo's own settings).

Flower hands both over as flat dicts of str/int/float/bool with kebab-case keys. They are
validated here, at the edge, so that a typo or a bad value stops the run with one line that
names the key and what was expected, instead of a traceback rounds later.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .data import Topology

METHODS = ("rdpcfl", "global", "local", "ifca", "mrmtl", "oracle", "km")


class ConfigError(ValueError):
    """A run or node config that cannot be used; its message is one line for people."""


def _kebab(name: str) -> str:
    return name.replace("_", "-")


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", alias_generator=_kebab, populate_by_name=True,
                              frozen=True)


class ExperimentConfig(_Config):
    """Everything the server proposes for a run (``[tool.flwr.app.config]`` + overrides)."""

    method: Literal["rdpcfl", "global", "local", "ifca", "mrmtl", "oracle", "km"] = "rdpcfl"
    # data: the paper's cluster-structured split (docs/experiments.md)
    dataset: Literal["fmnist", "mnist", "cifar10"] = "fmnist"
    data_dir: str = ""
    shift: Literal["rotation", "label_flip"] = "rotation"
    clusters: str = "3,6,6,6"
    samples_per_client: int = Field(500, ge=2)
    val_fraction: float = Field(0.25, gt=0.0, le=1.0)
    test_samples: int = Field(0, ge=0, description="0: the dataset's default (|test| / 6)")
    # "authors": seed s gives every silo the records the authors' code gives it with --seed s,
    # so a run can be set beside theirs; "per-client": each silo's draw seeded on its own
    data_draw: Literal["per-client", "authors"] = "authors"
    model: Literal["cnn", "resnet18"] = "cnn"
    # training schedule (docs/algorithm.md#hyper-parameters-and-defaults)
    num_server_rounds: int = Field(30, ge=1)
    local_epochs: int = Field(1, ge=1)
    batch_size: int = Field(32, ge=1)
    first_batch: str = "full"
    learning_rate: float = Field(0.005, gt=0.0)
    clip_norm: float = Field(3.0, gt=0.0)
    # privacy: defaults for silos whose node config does not set their own budget
    epsilon: float = Field(10.0, gt=0.0)
    delta: float = Field(1e-4, gt=0.0, lt=1.0)
    conversion: Literal["classic", "tight"] = "classic"
    budget_mode: Literal["split", "joint"] = "split"
    # simulation only (a deployed silo sets its own): "exact" metrics or "private" ones, noised
    # with this noise multiplier on a correct-prediction count and charged (README, Privacy)
    metrics: Literal["exact", "private"] = "exact"
    metrics_noise: float = Field(10.0, gt=0.0, allow_inf_nan=False)
    select_ratio: float = Field(0.03, gt=0.0, lt=1.0)
    selection: Literal["window", "every-round"] = "window"
    select_window: float = Field(0.1, gt=0.0, le=1.0)
    # clustering (docs/algorithm.md#stage-1-clustering-the-round-1-updates)
    n_clusters: int = Field(4, ge=0, description="0: choose M by maximum MSS")
    max_clusters: int = Field(10, ge=2)
    pca_components: int = Field(0, ge=0, description="0: M - 1 (at least 2); 2: the authors'")
    cluster_init: Literal["theta-init", "client0"] = "theta-init"
    aggregation: Literal["uniform", "samples"] = "uniform"
    mrmtl_lambda: float = Field(1.0, ge=0.0)
    mrmtl_variant: Literal["correct", "authors"] = "correct"
    # running
    eval_every: int = Field(5, ge=1)
    seed: int = 0
    threads: int = Field(1, ge=1)
    physical_batch_size: int = Field(0, ge=0, description="0: sized from a memory budget")
    out_dir: str = "results/latest"
    ledger_dir: str = ""
    round_timeout: float = Field(3600.0, gt=0.0)
    min_clients: int = Field(0, ge=0, description="0: every client of the topology")
    wait_for_clients: float = Field(600.0, gt=0.0)
    # after that wait (or once every silo present has answered), fewer silos that can run
    # than this stop the run before any trains
    required_clients: int = Field(0, ge=0, description="0: the fewest the method needs")

    @field_validator("clusters")
    @classmethod
    def _valid_topology(cls, value: str) -> str:
        Topology.parse(value)
        return value

    @field_validator("first_batch")
    @classmethod
    def _valid_first_batch(cls, value: str) -> str:
        if value != "full" and not (value.isdigit() and int(value) > 0):
            raise ValueError("must be 'full' or a positive integer")
        return value

    @property
    def topology(self) -> Topology:
        return Topology.parse(self.clusters)

    @property
    def first_round_batch(self) -> int | Literal["full"]:
        return "full" if self.first_batch == "full" else int(self.first_batch)

    @property
    def select_rounds(self) -> int:
        """T_sel: private selections a client reserves budget for (R-DPCFL, IFCA)."""
        if self.selection == "every-round":
            return self.num_server_rounds
        return max(1, int(self.select_window * self.num_server_rounds))

    @property
    def expected_clients(self) -> int:
        return self.min_clients or self.topology.num_clients

    def ledger_directory(self) -> Path:
        return Path(self.ledger_dir) if self.ledger_dir else Path(self.out_dir) / "ledgers"

    def to_run_config(self) -> dict[str, Any]:
        """The flat kebab-case dict Flower expects (inverse of :func:`parse_run_config`)."""
        return self.model_dump(by_alias=True)


class SiloConfig(_Config):
    """A silo's own settings (node config, from its silo file).

    In deployment these are the only source of the silo's budget, ledger, data split, noise
    seed and reporting policy: nothing the server sends can change them (docs/threat-model.md).
    ``epsilon``, ``delta`` and ``ledger-path`` must be set; an unset split key takes the
    default written in this code, never the run config's. Only in simulation, where one
    operator plays server and every silo, do unset keys come from the run config
    (:meth:`resolved`).
    """

    partition_id: int = Field(ge=0)
    num_partitions: int = Field(0, ge=0)
    epsilon: float | None = Field(None, gt=0.0)
    delta: float | None = Field(None, gt=0.0, lt=1.0)
    ledger_path: str = ""
    data_dir: str = ""
    # the silo's records: which dataset, and how its train / validation / test split is drawn
    dataset: Literal["fmnist", "mnist", "cifar10"] | None = None
    clusters: str | None = None
    shift: Literal["rotation", "label_flip"] | None = None
    samples_per_client: int | None = Field(None, ge=2)
    val_fraction: float | None = Field(None, gt=0.0, le=1.0)
    test_samples: int | None = Field(None, ge=0)
    data_draw: Literal["per-client", "authors"] | None = None
    data_seed: int | None = None
    # what the silo reports: "private" metrics are noised and charged, "exact" ones are an
    # opt-in for a trusted server (docs/threat-model.md)
    metrics: Literal["private", "exact"] | None = None
    metrics_noise: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    true_cluster: int = Field(-1, ge=-1, description="evaluation only; -1: from the topology")
    threads: int = Field(0, ge=0)
    device: str = "cpu"
    noise_seed: int = Field(-1, ge=-1, description="tests only: fixes DP noise; -1: OS entropy")

    @field_validator("device")
    @classmethod
    def _valid_device(cls, value: str) -> str:
        if value != "cpu" and not (value == "cuda" or value.startswith("cuda:")):
            raise ValueError("must be 'cpu', 'cuda' or 'cuda:<index>'")
        return value

    @field_validator("clusters")
    @classmethod
    def _valid_topology(cls, value: str | None) -> str | None:
        if value is not None:
            Topology.parse(value)
        return value

    def resolved(self, experiment: ExperimentConfig, trust_run_config: bool) -> SiloConfig:
        """Every setting filled in. ``trust_run_config`` (simulation only): unset keys come
        from the run config; otherwise the budget and ledger must be the silo's own and unset
        split keys take this code's defaults. Raises :class:`ConfigError` naming what is
        missing."""
        if trust_run_config:
            source = {key: getattr(experiment, key) for key in _SPLIT_KEYS}
            source.update(epsilon=experiment.epsilon, delta=experiment.delta,
                          data_seed=experiment.seed, metrics=experiment.metrics,
                          metrics_noise=experiment.metrics_noise, threads=experiment.threads,
                          ledger_path=str(experiment.ledger_directory()
                                          / f"silo-{self.partition_id}.json"),
                          data_dir=experiment.data_dir)
        else:
            missing = [_kebab(key) for key in DEPLOYMENT_REQUIRED if not getattr(self, key)]
            if missing:
                raise ConfigError(
                    f"node config: {', '.join(missing)} must be set in the silo's own node "
                    "config (silo file); a deployed silo never takes its budget or ledger "
                    "from the server")
            source = {key: ExperimentConfig.model_fields[key].default for key in _SPLIT_KEYS}
            source.update(data_seed=ExperimentConfig.model_fields["seed"].default,
                          metrics="private",
                          metrics_noise=ExperimentConfig.model_fields["metrics_noise"].default,
                          threads=1)
        return self.model_copy(update={key: value for key, value in source.items()
                                       if self._unset(key)})

    def _unset(self, key: str) -> bool:
        """None, an empty path, or (threads) 0: the markers of a key the silo left unset; an
        explicit 0 elsewhere (``data-seed = 0``) is the silo's choice."""
        value = getattr(self, key)
        return value is None or value == "" or (key == "threads" and value == 0)

    @property
    def topology(self) -> Topology:
        """The topology of a resolved config (the silo's cluster comes from it)."""
        return Topology.parse(self.clusters or ExperimentConfig.model_fields["clusters"].default)


#: The data-split settings a silo reads from its node config (simulation: the run config).
_SPLIT_KEYS = ("dataset", "clusters", "shift", "samples_per_client", "val_fraction",
               "test_samples", "data_draw")
#: What a deployed silo must set itself: no default could be right for every silo.
DEPLOYMENT_REQUIRED = ("epsilon", "delta", "ledger_path")


def _one_line(error: ValidationError, what: str, model: type[_Config]) -> ConfigError:
    first = error.errors()[0]
    key = ".".join(str(part) for part in first["loc"]) or "?"
    if first["type"] == "extra_forbidden":
        allowed = ", ".join(sorted(_kebab(name) for name in model.model_fields))
        return ConfigError(f"{what}: unknown key '{key}' (allowed keys: {allowed})")
    if first["type"] == "missing":
        return ConfigError(f"{what}: '{key}' is missing")
    value = first.get("input")
    message = first["msg"].removeprefix("Value error, ")
    return ConfigError(f"{what}: '{key}' = {value!r} is invalid: {message}")


def parse_run_config(raw: Mapping[str, Any]) -> ExperimentConfig:
    """Validate Flower's run config; raises :class:`ConfigError` with one line."""
    try:
        return ExperimentConfig.model_validate(dict(raw))
    except ValidationError as exc:
        raise _one_line(exc, "run config", ExperimentConfig) from None


def parse_node_config(raw: Mapping[str, Any]) -> SiloConfig:
    """Validate a silo's node config; raises :class:`ConfigError` with one line."""
    try:
        return SiloConfig.model_validate(dict(raw))
    except ValidationError as exc:
        raise _one_line(exc, "node config", SiloConfig) from None
