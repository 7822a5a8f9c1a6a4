"""A run's checkpoint: all the server needs to continue after its process died.

Written after every completed round (training and, in evaluation rounds, evaluation) to
``<out-dir>/checkpoint.pkl``, atomically: a reader sees the last round's file or the one
before, never half of one. It holds the round number, the run config, the cluster models, the
method's own state (assignments, clustering, choices), the silos by partition id, the round
reports and results rows so far, and the run key the silos key their noise plan by
(docs/experiments.md#resuming-a-run).

The file is the server's own and is read only by the server that wrote the run (``dpcfl
simulate --resume``, ``dpcfl submit --resume``): it is a pickle, which runs code when loaded,
so never resume from a directory someone else handed you.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..config.settings import OPERATIONAL_KEYS, ExperimentConfig
from ..config.validation import ConfigError
from ..files import write_atomically
from ..methods.base import SiloInfo

CHECKPOINT = "checkpoint.pkl"
#: Format of the file; a checkpoint of another format is refused.
VERSION = 1


@dataclass
class Checkpoint:
    """The run after round :attr:`round` (see the module docstring); seconds of wall time."""

    round: int
    run_config: dict[str, Any]
    run_key: int
    models: list[np.ndarray]
    method: dict[str, Any]
    silos: dict[int, SiloInfo]
    reports: list[Any]
    rows: list[dict[str, Any]] = field(default_factory=list)
    wall_seconds: float = 0.0
    version: int = VERSION
    #: the epsilon every silo was asked to calibrate for (minimum-epsilon rule), else 0
    epsilon_target: float = 0.0


def checkpoint_path(experiment: ExperimentConfig) -> Path:
    return Path(experiment.out_dir) / CHECKPOINT


def save_checkpoint(path: Path, checkpoint: Checkpoint) -> None:
    """Write ``checkpoint`` to ``path`` atomically and durably (temp file, fsync, rename)."""
    write_atomically(path, lambda handle: pickle.dump(checkpoint, handle,
                                                      protocol=pickle.HIGHEST_PROTOCOL))


def load_checkpoint(path: Path, experiment: ExperimentConfig) -> Checkpoint:
    """The checkpoint at ``path`` for ``experiment``'s run; :class:`ConfigError` with one line
    when there is none, it is of another format, or of another run config."""
    checkpoint = read_checkpoint(path)
    differing = run_config_differences(checkpoint.run_config, experiment.to_run_config())
    if differing:
        raise ConfigError(f"cannot resume from {path}: it is of another run config "
                          f"({'; '.join(differing[:3])}{'; ...' if len(differing) > 3 else ''})")
    return checkpoint


def read_checkpoint(path: Path) -> Checkpoint:
    """The checkpoint at ``path`` whatever its run; :class:`ConfigError` with one line when
    there is none or it is of another format."""
    try:
        with path.open("rb") as handle:
            checkpoint = pickle.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"nothing to resume: {path} does not exist (the run completed no "
                          "round, or this is not its results directory)") from None
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError) as exc:
        raise ConfigError(f"cannot resume from {path}: {exc}") from None
    if not isinstance(checkpoint, Checkpoint) or checkpoint.version != VERSION:
        raise ConfigError(f"cannot resume from {path}: not a checkpoint of this version")
    return checkpoint


def run_config_differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """'key = <saved> there, <now> here' for each key (not operational) that differs."""
    keys = sorted((set(saved) | set(now)) - OPERATIONAL_KEYS)
    return [f"{key} = {saved.get(key)!r} there, {now.get(key)!r} here" for key in keys
            if saved.get(key) != now.get(key)]
