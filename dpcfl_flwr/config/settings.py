"""Typed run config (the experiment, from the server) and node config (the silo's own settings).

Flower hands both over as flat dicts of str/int/float/bool with kebab-case keys. They are
validated here, at the edge, so that a typo or a bad value stops the run with one line that
names the key and what was expected, instead of a traceback rounds later.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from ..data import Topology
from ..data.schema import Schema, parse_features, parse_floats
from ..data.sources import RECORDS_MEMORY_MIB, is_source, source_names
from ..models.registry import (
    ENTRY_POINT_GROUP,
    PARAMS_TABLE,
    ModelSpec,
    is_model,
    model_entry,
    model_names,
    params_table,
    validate_params,
)
from ..models.trainable import parse_prefixes
from ..privacy.defaults import (
    DEFAULT_ACCOUNTANT,
    DEFAULT_BUDGET_MODE,
    DEFAULT_CONVERSION,
    AccountantName,
    BudgetMode,
    Conversion,
)
from ..privacy.schedule import check_candidates
from . import registry
from .heterogeneity import partition_list, per_silo_values
from .validation import ConfigError, ConfigModel, kebab, one_line_error

#: The default candidates' step lengths, learning rate x clip norm: how far one step on
#: clipped gradients may move the weights (a record's clipped gradient has norm at most C,
#: so the learning rate that gives a step length scales as 1 / C). Half-decades that span
#: the rates good DP-SGD runs use on standardised inputs; the silo picks among them
#: privately (docs/algorithm.md#choosing-the-learning-rate).
STEP_LENGTHS = (0.015, 0.05, 0.15, 0.5)


class ExperimentConfig(ConfigModel):
    """Everything the server proposes for a run (``[tool.flwr.app.config]`` + overrides).

    The keys here are every method's; each method's own parameters are its table
    (``[rdpcfl]`` in a config file, ``rdpcfl.n-clusters`` in the flat run config), validated
    by the method's :attr:`~dpcfl_flwr.methods.base.Method.Params` and held in
    :attr:`methods` (every registered method's, defaults filled in)."""

    method: str = Field("rdpcfl", description="a registered method (dpcfl_flwr.config.registry)")
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
    # simulation only (a deployed silo's own file names its records): every silo's data
    # source, and silo i's records at item i of silo-data-paths (comma-separated, or one path
    # with {partition} in it), given split in a table's split-column (docs/own-data.md)
    data_source: str = "benchmark"
    silo_data_paths: str = ""
    split_column: str = ""
    # the model (docs/own-data.md#models): a registered name, its parameters (the
    # model-params table, held in model_params), Opacus' fix for layers DP-SGD cannot train,
    # a pretrained start read by the server (a path from the server's working directory)
    # and the parameter-name prefixes to train (empty: all)
    model: str = Field("cnn", description="a registered model (dpcfl_flwr.models.registry)")
    model_fix: bool = False
    initial_weights: str = ""
    trainable: str = ""
    # the federation's data schema (docs/own-data.md): every silo's records have this input
    # shape ("channels,height,width", a table's "width"; empty: the benchmark dataset's, or
    # the features' width) and labels 0..C-1, named in order by class-names (optional); a
    # table's feature columns in order ("age:number(54,9), sex:category(f|m)"), its label
    # column and its rule for missing values; images normalised per channel after scaling
    # pixels to [0, 1] (one value, or one per channel; empty: not normalised)
    input_shape: str = ""
    num_classes: int = Field(10, ge=2)
    class_names: str = ""
    features: str = ""
    label_column: str = "label"
    missing_values: Literal["refuse", "fill"] = "refuse"
    image_mean: str = ""
    image_std: str = ""
    # without image-mean / image-std, an image folder's or arrays' records are standardised
    # one record at a time (docs/own-data.md#input-scaling), or taken as read ("none")
    input_scaling: Literal["per-record", "none"] = "per-record"
    # training schedule (docs/algorithm.md#hyper-parameters-and-defaults)
    num_server_rounds: int = Field(30, ge=1)
    local_epochs: int = Field(1, ge=1)
    batch_size: int = Field(32, ge=1)
    # 0: each silo chooses its own, privately, among learning-rate-candidates in its first
    # training round (docs/algorithm.md#choosing-the-learning-rate); empty candidates: the
    # rule's (STEP_LENGTHS / clip-norm)
    learning_rate: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    learning_rate_candidates: str = ""
    clip_norm: float = Field(3.0, gt=0.0)
    # privacy: defaults for silos whose node config does not set their own budget
    epsilon: float = Field(10.0, gt=0.0)
    delta: float = Field(1e-4, gt=0.0, lt=1.0)
    # how the budget is accounted (docs/privacy.md#the-default-accounting): by default
    # everything composed jointly, converted once, so a run spends its whole budget; the
    # paper-scale examples name the authors' ("split", "classic", "rdp")
    conversion: Conversion = DEFAULT_CONVERSION
    budget_mode: BudgetMode = DEFAULT_BUDGET_MODE
    # how spend is measured (docs/privacy.md#pld-accounting): proposed to every silo; a
    # silo's node config decides for itself, and only in simulation does an unset one follow
    accountant: AccountantName = DEFAULT_ACCOUNTANT
    # simulation only (a deployed silo sets its own): "exact" metrics or "private" ones, noised
    # with this noise multiplier on a correct-prediction count and charged
    # (docs/privacy.md#private-evaluation-metrics)
    metrics: Literal["exact", "private"] = "exact"
    metrics_noise: float = Field(10.0, gt=0.0, allow_inf_nan=False)
    # how a cluster model combines its trainers' updates (docs/aggregation.md): a rule of
    # dpcfl_flwr.aggregation.RULES, and Robust-HDP's RPCA settings
    aggregation: str = "uniform"
    rpca_rows: int = Field(200_000, ge=1, description="p': RPCA on the first p' coordinates")
    rpca_min_silos: int = Field(5, ge=2, description="fewer: the cluster falls back to samples")
    # simulation only: silos that differ (dpcfl_flwr/config/heterogeneity.py,
    # docs/heterogeneous-silos.md); a deployed silo's own file sets its values
    silo_epsilons: str = ""
    silo_deltas: str = ""
    silo_batch_sizes: str = ""
    silo_samples: str = ""
    lying_silos: str = ""
    lie_factor: float = Field(10.0, gt=0.0, allow_inf_nan=False)
    # running
    eval_every: int = Field(5, ge=1)
    seed: int = 0
    threads: int = Field(1, ge=1)
    # simulation only: what Ray reserves for each silo's actor, so how many silos of a node
    # train at once (a node's CPUs / silo-cpus); a GPU share only reserves the GPU in Ray's
    # scheduling, the silo's training stays on the CPU (docs/simulation.md#resources-per-silo)
    silo_cpus: float = Field(1.0, gt=0.0, allow_inf_nan=False)
    silo_gpus: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    physical_batch_size: int = Field(0, ge=0, description="0: sized from a memory budget")
    out_dir: str = "results/latest"
    # per-round metrics also as TensorBoard event files in <out-dir>/tensorboard
    # (docs/experiments.md#watching-a-run-in-tensorboard)
    tensorboard: bool = True
    ledger_dir: str = ""
    round_timeout: float = Field(3600.0, gt=0.0)
    min_clients: int = Field(0, ge=0, description="0: every client of the topology")
    wait_for_clients: float = Field(600.0, gt=0.0)
    # after that wait (or once every silo present has answered), fewer silos that can run
    # than this stop the run before any trains
    required_clients: int = Field(0, ge=0, description="0: the fewest the method needs")
    # continue the run whose results directory is out-dir from its last completed round
    # (docs/experiments.md#resuming-a-run); set by `dpcfl simulate --resume`
    resume: bool = False
    # simulation only, for reproducible experiments: fixes every silo's DP noise (silo i draws
    # from seed 1000 x noise-seed + i); -1: fresh OS entropy. Noise someone can reproduce
    # protects nothing from them: never for data that needs protecting. A deployed silo
    # ignores it (its noise is its own).
    noise_seed: int = Field(-1, ge=-1)
    #: every registered method's parameter table, by method name (see parse_run_config)
    methods: dict[str, BaseModel] = Field(default_factory=dict, exclude=True)
    #: the model's parameters: its model-params table, validated by the model's own type
    model_params: Any = Field(None, exclude=True)

    @field_validator("method")
    @classmethod
    def _registered(cls, value: str) -> str:
        names = registry.method_names()
        if value not in names:
            raise ValueError(f"not a registered method; choose from {', '.join(names)}")
        return value

    @field_validator("data_source")
    @classmethod
    def _installed_source(cls, value: str) -> str:
        if not is_source(value):
            raise ValueError(f"not an installed data source; choose from "
                             f"{', '.join(source_names())}")
        return value

    @field_validator("model")
    @classmethod
    def _installed_model(cls, value: str) -> str:
        if not is_model(value):
            raise ValueError(f"not an installed model; choose from {', '.join(model_names())} "
                             f"(plug-ins: entry point group {ENTRY_POINT_GROUP})")
        return value

    @model_validator(mode="after")
    def _model_params(self) -> ExperimentConfig:
        """The model's parameters as its own type (defaults when the table is absent)."""
        entry = model_entry(self.model)
        if not isinstance(self.model_params, entry.params_type):
            table = self.model_params or {}
            if not isinstance(table, dict):
                raise ValueError(f"{PARAMS_TABLE} must be a table of the model's parameters")
            object.__setattr__(self, "model_params", validate_params(entry, table))
        return self

    @property
    def model_spec(self) -> ModelSpec:
        """The run's model, as server and silos build it (:func:`dpcfl_flwr.models.build`)."""
        return ModelSpec(self.model, self.num_classes, self.record_shape,
                         tuple(sorted(params_table(self.model_params).items())),
                         self.model_fix, parse_prefixes(self.trainable))

    @field_validator("input_shape", mode="before")
    @classmethod
    def _valid_shape(cls, value: Any) -> Any:
        # one size (a table's features: `--set input-shape=14`) arrives as a number
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        if isinstance(value, str) and value.strip():
            parse_shape(value)
        return value

    @field_validator("features")
    @classmethod
    def _valid_features(cls, value: str) -> str:
        if value.strip():
            parse_features(value)
        return value

    @field_validator("image_mean", "image_std")
    @classmethod
    def _valid_floats(cls, value: str) -> str:
        parse_floats(value)
        return value

    @field_validator("learning_rate_candidates")
    @classmethod
    def _valid_candidates(cls, value: str) -> str:
        check_candidates(parse_floats(value))
        return value

    @model_validator(mode="after")
    def _valid_schema(self) -> ExperimentConfig:
        self.data_schema  # noqa: B018 - builds the schema, raising ValueError naming what is wrong
        return self

    @property
    def tuned_learning_rates(self) -> tuple[float, ...]:
        """The candidates each silo chooses its learning rate among (empty: the run config
        sets one): learning-rate-candidates, else :data:`STEP_LENGTHS` / clip-norm."""
        if self.learning_rate > 0:
            return ()
        if self.learning_rate_candidates.strip():
            return tuple(sorted(parse_floats(self.learning_rate_candidates)))
        return tuple(length / self.clip_norm for length in STEP_LENGTHS)

    @property
    def base_learning_rate(self) -> float:
        """The learning rate of rounds before a silo has chosen its own (R-DPCFL's round 1,
        whose clustering does not depend on the step's scale): the one set, else the
        candidates' geometric middle."""
        grid = self.tuned_learning_rates
        return self.learning_rate if not grid else math.sqrt(grid[0] * grid[-1])

    @property
    def record_shape(self) -> tuple[int, ...]:
        """The input shape every silo's records must have (the schema's, else the features'
        width, else the benchmark dataset's)."""
        if self.input_shape.strip():
            return parse_shape(self.input_shape)
        if self.features.strip():
            return (sum(f.width for f in parse_features(self.features)),)
        return (3, 32, 32) if self.dataset == "cifar10" else (1, 28, 28)

    @property
    def data_schema(self) -> Schema:
        """The federation's data schema (dpcfl_flwr.data.schema)."""
        names = tuple(n.strip() for n in self.class_names.split(",")) \
            if self.class_names.strip() else ()
        return Schema(self.record_shape, self.num_classes, names,
                      parse_features(self.features) if self.features.strip() else (),
                      self.label_column, self.missing_values, parse_floats(self.image_mean),
                      parse_floats(self.image_std), self.input_scaling)

    @field_validator("clusters", mode="before")
    @classmethod
    def _valid_topology(cls, value: Any) -> str:
        # one cluster is a bare number (`--set clusters=20`, `clusters = 20` in TOML)
        value = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
        Topology.parse(value)
        return str(value)

    @field_validator("silo_epsilons", "silo_deltas", "silo_batch_sizes", "silo_samples",
                     "lying_silos", "image_mean", "image_std", "learning_rate_candidates",
                     mode="before")
    @classmethod
    def _one_value_list(cls, value: Any) -> Any:
        """A list of one (``--set lying-silos=3``, ``--set image-mean=0.5``) arrives as a
        number."""
        return str(value) if isinstance(value, int | float) and not isinstance(value, bool) \
            else value

    @field_validator("aggregation")
    @classmethod
    def _known_rule(cls, value: str) -> str:
        from ..aggregation import RULES
        if value not in RULES:
            raise ValueError(f"not an aggregation rule; choose from {', '.join(RULES)}")
        return value

    @model_validator(mode="after")
    def _valid_silo_values(self) -> ExperimentConfig:
        """Every per-silo list readable, one value per silo of the topology."""
        self.silo_overrides(0)  # reads every list (and the liars) once
        deltas = per_silo_values("silo-deltas", self.silo_deltas, self.topology.num_clients,
                                 float) or ()
        if any(delta >= 1.0 for delta in deltas):
            raise ValueError(f"silo-deltas = {self.silo_deltas!r}: every delta must be below 1")
        return self

    def silo_overrides(self, partition: int) -> dict[str, Any]:
        """Silo ``partition``'s own values from the per-silo keys (simulation): the node-config
        keys they set, absent when the key is empty. ValueError names a bad key."""
        count = self.topology.num_clients
        values: dict[str, Any] = {}
        for key, field_name, cast in _PER_SILO:
            listed = per_silo_values(key, getattr(self, key.replace("-", "_")), count, cast)
            if listed is not None and partition < count:
                values[field_name] = listed[partition]
        if partition in partition_list("lying-silos", self.lying_silos, count):
            values["reported_epsilon"] = self.lie_factor * values.get("epsilon", self.epsilon)
        path = self.silo_data_path(partition)
        if path:
            values["data_path"] = path
        if self.data_source != "benchmark" and partition < count:
            # the topology is the operator's label of each silo's group (evaluation only)
            values["true_cluster"] = self.topology.cluster_of(partition)
        return values

    def silo_data_path(self, partition: int) -> str:
        """Silo ``partition``'s records in simulation (empty: none named). ValueError when
        the list does not give one path per silo."""
        spec = self.silo_data_paths.strip()
        if not spec:
            return ""
        if "{partition}" in spec:
            return spec.replace("{partition}", str(partition))
        paths = [part.strip() for part in spec.split(",")]
        count = self.topology.num_clients
        if len(paths) != count or not all(paths):
            raise ValueError(f"silo-data-paths gives {len(paths)} paths for {count} silos "
                             "(one per silo, comma-separated, or one path with {partition})")
        return paths[partition] if partition < count else ""

    @model_validator(mode="after")
    def _rule_applies(self) -> ExperimentConfig:
        """Only a method whose models are weighted means of updates takes another rule."""
        if self.aggregation != "uniform" and not registry.method_class(
                self.method).weighs_updates:
            raise ValueError(f"method {self.method} combines its updates its own way: "
                             f"aggregation = {self.aggregation!r} would not apply (leave it "
                             "'uniform')")
        return self

    @model_validator(mode="after")
    def _every_table(self) -> ExperimentConfig:
        """Methods without a table of their own get their defaults."""
        missing = {name: cls.Params() for name, cls in registry.methods().items()
                   if name not in self.methods}
        if missing:
            object.__setattr__(self, "methods", {**self.methods, **missing})
        return self

    def too_few_silos(self) -> str | None:
        """Why the topology has fewer silos than the method can run with (R-DPCFL with M = 4
        on 3 silos), in one line; None when it has enough. `dpcfl simulate` and `dpcfl
        submit` ask before they start a run, rather than the server stopping it once the
        silos have connected. (Not a validator: a silo parses run configs of any size.)"""
        needed = registry.method_class(self.method).fewest_silos(self.params)
        count = self.topology.num_clients
        if needed <= count:
            return None
        clusters = getattr(self.params, "n_clusters", None)
        settings = "" if clusters is None else f", n-clusters = {clusters}"
        return (f"method {self.method}{settings} needs at least {needed} silos, but "
                f"clusters = {self.clusters!r} has {count}")

    @property
    def params(self) -> BaseModel:
        """The parameter table of the run's method."""
        return self.methods[self.method]

    @property
    def topology(self) -> Topology:
        return Topology.parse(self.clusters)

    @property
    def expected_clients(self) -> int:
        return self.min_clients or self.topology.num_clients

    def ledger_directory(self) -> Path:
        return Path(self.ledger_dir) if self.ledger_dir else Path(self.out_dir) / "ledgers"

    def to_run_config(self) -> dict[str, Any]:
        """The flat kebab-case dict Flower expects, method tables as ``<method>.<key>`` and
        the model's parameters that differ from its defaults as ``model-params.<key>``
        (inverse of :func:`parse_run_config`)."""
        flat = self.model_dump(by_alias=True)
        flat.update({f"{PARAMS_TABLE}.{key}": value
                     for key, value in params_table(self.model_params).items()})
        for name, params in self.methods.items():
            flat.update({f"{name}.{key}": value
                         for key, value in params.model_dump(by_alias=True).items()})
        return flat


class SiloConfig(ConfigModel):
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
    # how much of ``epsilon`` one run plans to spend: a run is calibrated to end at what
    # earlier runs spent plus this (at most ``epsilon``); unset: all that is left, so a
    # silo's first run spends its whole budget and a later run finds none
    # (docs/privacy.md#runs-after-the-first). The ledger's limit stays ``epsilon``
    run_epsilon: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    ledger_path: str = ""
    data_dir: str = ""
    # the silo's records (docs/own-data.md): a benchmark dataset with the paper's shift
    # ("benchmark", the keys below), or its own records at data-path ("arrays",
    # "image-folder", "table", or an installed plug-in's source), split with its data-seed
    # (test-fraction for test, val-fraction of the rest for validation) unless the records
    # give the split (a table's split-column: train / val / test). schema-file: the
    # federation's schema as the silo expects it (a TOML file of the run config's schema
    # keys), so that `dpcfl client` checks the records fully before it joins.
    # records-memory (MiB): what the silo's records may take in memory; records whose float32
    # tensors (records x input size x 4 bytes) fit are read in when the silo starts, larger
    # image folders and Parquet tables (and .npy arrays always) are read when used, with a
    # cache of at most this size (docs/own-data.md#data-larger-than-memory)
    data_source: str | None = None
    data_path: str = ""
    records_memory: int = Field(RECORDS_MEMORY_MIB, ge=1)
    split_column: str = ""
    # a table's columns the silo leaves out (comma-separated); any other column the schema
    # does not list refuses the table
    ignore_columns: str = ""
    schema_file: str = ""
    test_fraction: float | None = Field(None, gt=0.0, lt=1.0)
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
    # the silo's own expected batch size b_i (records) for DP-SGD steps below rate 1; unset:
    # the server's proposal (docs/heterogeneous-silos.md)
    batch_size: int | None = Field(None, ge=1)
    # attack experiments only: the budget the silo *tells* the server; it still calibrates its
    # noise for, and spends within, its real ``epsilon``
    reported_epsilon: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    # how the silo privatises what it releases (docs/dprivacy.md): DP-SGD, or d-privacy's
    # sanitised model with its own noise multiplier v and leakage budget (sum of n/v; 0: no
    # limit). A run asking for another privatiser is refused. Unset: DP-SGD (deployment).
    privatiser: Literal["dpsgd", "dprivacy"] | None = None
    dprivacy_noise: float | None = Field(None, ge=0.0, allow_inf_nan=False)
    dprivacy_leakage_budget: float | None = Field(None, ge=0.0, allow_inf_nan=False)
    # the silo's accountant (docs/privacy.md#pld-accounting); unset: "pld" (deployment), the
    # run config's (simulation)
    accountant: AccountantName | None = None
    # what one message may make the silo do (docs/threat-model.md#work-per-message): cluster
    # models scored in one selection, and DP-SGD steps in one round (the paper's settings
    # run at most 250: N = 8000, b = 32, one local epoch)
    max_candidates: int = Field(16, ge=1)
    max_round_steps: int = Field(10_000, ge=1)
    # what one run config may make the silo build, checked before its model exists
    # (docs/threat-model.md#work-per-message): the model's tensors (values), its classes, the
    # physical batch of per-sample gradients (records), and a round's estimated peak of model
    # and training memory beyond the process's own and its records' (MiB). The paper's
    # ResNet-18 has 11.2 M values and its rounds estimate at ~0.9 GiB.
    max_model_parameters: int = Field(50_000_000, ge=1)
    max_classes: int = Field(10_000, ge=2)
    max_physical_batch: int = Field(4096, ge=1)
    max_round_memory: int = Field(4096, ge=1)
    # whether replies carry the handler's CPU seconds: a timing that follows the number of
    # records Poisson sampling drew, so off in deployment unless the silo opts in; unset:
    # on in simulation (one operator), off in deployment
    report_cpu_seconds: bool | None = None

    @field_validator("device")
    @classmethod
    def _valid_device(cls, value: str) -> str:
        if value != "cpu" and not (value == "cuda" or value.startswith("cuda:")):
            raise ValueError("must be 'cpu', 'cuda' or 'cuda:<index>'")
        return value

    @field_validator("data_source")
    @classmethod
    def _known_source(cls, value: str | None) -> str | None:
        if value is not None and not is_source(value):
            raise ValueError(f"not a data source installed on this silo; choose from "
                             f"{', '.join(source_names())}")
        return value

    @field_validator("clusters")
    @classmethod
    def _valid_topology(cls, value: str | None) -> str | None:
        if value is not None:
            Topology.parse(value)
        return value

    def resolved(self, experiment: ExperimentConfig | None, trust_run_config: bool
                 ) -> SiloConfig:
        """Every setting filled in. ``trust_run_config`` (simulation only): unset keys come
        from the run config; otherwise the budget and ledger must be the silo's own and unset
        split keys take this code's defaults, and ``experiment`` is not read (None will do:
        ``dpcfl client`` resolves a silo's settings without a run config, and so without
        loading every method and model). Raises :class:`ConfigError` naming what is
        missing."""
        if trust_run_config:
            if experiment is None:
                raise TypeError("a silo that trusts the run config needs the run config")
            source = self._from_run_config(experiment)
        else:
            source = self._deployment_defaults()
        source.setdefault("privatiser", "dpsgd")
        source.setdefault("data_source", "benchmark")
        source.setdefault("test_fraction", 0.2)
        source.setdefault("report_cpu_seconds", trust_run_config)
        source.setdefault("accountant", DEFAULT_ACCOUNTANT)
        resolved = self.model_copy(update={key: value for key, value in source.items()
                                           if self._unset(key)})
        if resolved.data_source != "benchmark" and not resolved.data_path:
            raise ConfigError(f"node config: data-source = {resolved.data_source} needs "
                              "data-path (the silo's records: a file or directory)")
        if resolved.privatiser == "dprivacy":
            missing = [kebab(key) for key in ("dprivacy_noise", "dprivacy_leakage_budget")
                       if getattr(resolved, key) is None]
            if missing:
                raise ConfigError(f"node config: privatiser = dprivacy needs "
                                  f"{' and '.join(missing)} in the silo's own node config")
        return resolved

    def _from_run_config(self, experiment: ExperimentConfig) -> dict[str, Any]:
        """Simulation: the settings an unset key takes from the run config."""
        source = {key: getattr(experiment, key) for key in _SPLIT_KEYS}
        source.update(epsilon=experiment.epsilon, delta=experiment.delta,
                      data_seed=experiment.seed, metrics=experiment.metrics,
                      metrics_noise=experiment.metrics_noise, threads=experiment.threads,
                      ledger_path=str(experiment.ledger_directory()
                                      / f"silo-{self.partition_id}.json"),
                      data_dir=experiment.data_dir, accountant=experiment.accountant)
        if self.noise_seed < 0 <= experiment.noise_seed:
            source["noise_seed"] = 1000 * experiment.noise_seed + self.partition_id
        source.update(experiment.silo_overrides(self.partition_id))
        source.update(registry.method_class(experiment.method).silo_defaults(experiment.params))
        return source

    def _deployment_defaults(self) -> dict[str, Any]:
        """Deployment: the code's defaults for unset keys; ConfigError without the silo's own
        budget or ledger."""
        missing = [kebab(key) for key in DEPLOYMENT_REQUIRED if not getattr(self, key)]
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
        return source

    def _unset(self, key: str) -> bool:
        """None, an empty path, or (threads) 0: the markers of a key the silo left unset; an
        explicit 0 elsewhere (``data-seed = 0``) is the silo's choice."""
        value = getattr(self, key)
        return (value is None or value == "" or (key == "threads" and value == 0)
                or (key in ("noise_seed", "true_cluster") and value < 0))

    @property
    def topology(self) -> Topology:
        """The topology of a resolved config (the silo's cluster comes from it)."""
        return Topology.parse(self.clusters or ExperimentConfig.model_fields["clusters"].default)


def parse_shape(text: str) -> tuple[int, ...]:
    """``"1,28,28"`` as a shape of positive integers; ValueError naming what is wrong."""
    try:
        shape = tuple(int(part) for part in str(text).split(","))
    except ValueError:
        raise ValueError(f"{text!r} is not a comma-separated list of integers") from None
    if not shape or any(size < 1 for size in shape):
        raise ValueError(f"{text!r}: every size must be a positive integer")
    return shape


#: Run-config keys a resumed run (and a kept cell of a compare grid) may change: where it
#: writes, how long it waits, what each silo holds of the machine, not anything a round
#: computes.
OPERATIONAL_KEYS = frozenset({"out-dir", "resume", "round-timeout", "wait-for-clients",
                              "threads", "tensorboard", "silo-cpus", "silo-gpus"})


#: Per-silo run-config keys (simulation), the SiloConfig field each sets, and its type.
_PER_SILO = (("silo-epsilons", "epsilon", float), ("silo-deltas", "delta", float),
             ("silo-batch-sizes", "batch_size", int), ("silo-samples", "samples_per_client", int))


#: The data-split settings a silo reads from its node config (simulation: the run config).
_SPLIT_KEYS = ("dataset", "clusters", "shift", "samples_per_client", "val_fraction",
               "test_samples", "data_draw", "data_source", "split_column")
#: What a deployed silo must set itself: no default could be right for every silo.
DEPLOYMENT_REQUIRED = ("epsilon", "delta", "ledger_path")


def parse_run_config(raw: Mapping[str, Any]) -> ExperimentConfig:
    """Validate Flower's run config, method tables included (``<method>.<key>``: Flower
    flattens a TOML table ``[rdpcfl]`` to ``rdpcfl.<key>``) and the model's parameters
    (``model-params.<key>``, the table the chosen model validates); raises
    :class:`ConfigError` with one line."""
    base: dict[str, Any] = {}
    tables: dict[str, dict[str, Any]] = {}
    for key, value in raw.items():
        name, dot, inner = key.partition(".")
        if dot:
            tables.setdefault(name, {})[inner] = value
        else:
            base[key] = value
    base[PARAMS_TABLE] = tables.pop(PARAMS_TABLE, {})
    known = registry.methods()
    methods = {}
    for name, table in tables.items():
        if name not in known:
            raise ConfigError(f"run config: '{name}.{next(iter(table))}' belongs to no method "
                              f"(method tables: {', '.join(known)})")
        params = known[name].Params
        try:
            methods[name] = params.model_validate(table)
        except ValidationError as exc:
            raise one_line_error(exc, "run config", params, f"{name}.") from None
    for key in base:
        owners = sorted((name for name, cls in known.items() if _declares(cls.Params, key)),
                        key=lambda name: name != base.get("method", _DEFAULT_METHOD))
        if key not in ExperimentConfig.model_fields and owners:
            raise ConfigError(f"run config: '{key}' is a method's parameter: set it in the "
                              f"method's table, e.g. '{owners[0]}.{key}' (a config file: "
                              f"'{key}' in table {owners[0]})")
    try:
        return ExperimentConfig.model_validate({**base, "methods": methods})
    except ValidationError as exc:
        raise one_line_error(exc, "run config", ExperimentConfig) from None


_DEFAULT_METHOD = ExperimentConfig.model_fields["method"].default


def _declares(model: type[BaseModel], key: str) -> bool:
    """Whether ``model`` has a field whose config key is ``key``."""
    return any(key == (field.alias or kebab(name)) for name, field in model.model_fields.items())


def parse_node_config(raw: Mapping[str, Any]) -> SiloConfig:
    """Validate a silo's node config; raises :class:`ConfigError` with one line."""
    try:
        return SiloConfig.model_validate(dict(raw))
    except ValidationError as exc:
        raise one_line_error(exc, "node config", SiloConfig) from None
