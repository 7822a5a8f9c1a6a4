"""The silo's own copy of its result: the model it would use, on its own disk, next to its ledger.

At every evaluation a silo answers, it writes the model it was evaluated on (its cluster's
model, or its personal one: Local's kept model, MR-MTL's from the server) to
``<ledger without .json>.run-<run id>.model.pt`` beside its ledger, replacing the run's
earlier file: the file always holds the latest evaluated model of that run, and a second run
writes a file of its own. The evaluation of the run's last round marks it ``final``: the silo
compares ``server-round`` with the ``rounds`` of the schedule the run's first train message
announced (the schedule it calibrated its noise for), not with anything the evaluate message
says. Nothing leaves the silo, so writing costs no privacy; nothing replaces the run's final
model, so a server that asks again afterwards cannot take the result away, and before it an
earlier round never replaces a later one (:mod:`.model_files` names the files).

The file is one ``torch.save`` of ``{"state_dict": ..., "metadata": ...}``, written atomically
(temporary file, fsync, rename); :func:`load_silo_model` reads it back as a model. The metadata
holds JSON values only (``weights_only`` loading):

``format``, ``run_id``, ``partition_id``, ``round`` (the round evaluated), ``rounds`` (the
run's planned rounds; None if the silo never saw a train message of the run), ``final``,
``cluster`` (the cluster whose model it is; -3: the silo's own), ``own_model`` (cluster -3:
the personal model the silo kept, which never left it), ``model``, ``in_channels``,
``input_shape``, ``model_params`` (the model's run-config table, defaults left out),
``model_fix``, ``dataset``, ``test_accuracy``, ``test_loss`` (exact, on the silo's test split;
the loss of a silo with private metrics is the mean of per-record losses clipped to 10 nats),
``reported_test_accuracy``, ``reported_test_loss`` (what the evaluation reply carried: noised
with private metrics), ``metrics`` (``exact`` / ``private``), ``num_test``, ``epsilon_spent``,
``epsilon_budget``, ``delta``, ``ledger_path``, ``written_at`` (UTC, ISO 8601).
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ..files import write_atomically
from ..models import ModelSpec, build, image_model_spec
from ..protocol import OWN
from .model_files import SUFFIX, model_files, model_path

if TYPE_CHECKING:
    from .silo import Silo

logger = logging.getLogger(__name__)

#: Version of the file's layout; :func:`load_silo_model` refuses another.
FORMAT = 1


class SiloModel(NamedTuple):
    """A silo's model file, loaded: the model (eval mode, on the CPU) and its metadata."""

    model: torch.nn.Module
    metadata: dict[str, Any]


def _read(path: Path) -> dict[str, Any]:
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many kinds for a damaged or foreign file
        raise ValueError(f"{path}: not a silo model file ({type(exc).__name__}: {exc})"
                         ) from None
    metadata = payload.get("metadata") if isinstance(payload, dict) else None
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        raise ValueError(f"{path}: not a silo model file of format {FORMAT}")
    return payload


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The metadata of a model file; ValueError naming the file if it is not one."""
    return dict(_read(Path(path))["metadata"])


def load_silo_model(path: str | Path) -> SiloModel:
    """The model a silo wrote (:func:`model_path`), built and loaded, with its metadata.

    >>> model, meta = load_silo_model("ledgers/silo-3.run-42.model.pt")  # doctest: +SKIP
    >>> meta["final"], meta["test_accuracy"], meta["epsilon_spent"]  # doctest: +SKIP
    """
    payload = _read(Path(path))
    metadata = dict(payload["metadata"])
    model = build(_spec(metadata))
    model.load_state_dict(payload["state_dict"])
    return SiloModel(model.eval(), metadata)


def _spec(metadata: dict[str, Any]) -> ModelSpec:
    """The model a file's metadata names (files written before models had parameters: an
    image model of its ``in_channels`` with its defaults)."""
    name, classes = str(metadata["model"]), int(metadata.get("num_classes", 10))
    if "input_shape" not in metadata:
        return image_model_spec(name, classes, int(metadata["in_channels"]))
    shape = tuple(int(size) for size in metadata["input_shape"])
    params = tuple(sorted(dict(metadata.get("model_params", {})).items()))
    return ModelSpec(name, classes, shape, params, bool(metadata.get("model_fix", False)))


def _replaces(new: dict[str, Any], old: dict[str, Any] | None) -> bool:
    """Whether a model evaluated as ``new`` may replace the file holding ``old``: nothing
    replaces the final model (a server asking again after the run cannot take it away), the
    final one replaces any other, and an earlier round never replaces a later one."""
    if old is None:
        return True
    if old.get("final"):
        return False
    return bool(new["final"]) or int(new["round"]) >= int(old.get("round", 0))


def evaluated_metadata(silo: Silo, server_round: int, cluster: int, rounds: int | None,
                       reported: dict[str, float], exact: dict[str, float]) -> dict[str, Any]:
    """The metadata of the model ``silo`` was just evaluated on in ``server_round``."""
    settings = silo.silo
    return {
        "format": FORMAT, "run_id": int(silo.run_id), "partition_id": settings.partition_id,
        "round": server_round, "rounds": rounds,
        "final": rounds is not None and server_round == rounds,
        "cluster": cluster, "own_model": cluster == OWN, "model": silo.experiment.model,
        "in_channels": silo._channels(), "num_classes": silo.experiment.num_classes,
        "input_shape": list(silo.experiment.record_shape),
        "model_params": dict(silo.experiment.model_spec.params),
        "model_fix": silo.experiment.model_fix,
        "dataset": settings.dataset,
        "test_accuracy": float(exact["test-accuracy"]), "test_loss": float(exact["test-loss"]),
        "reported_test_accuracy": float(reported["test-accuracy"]),
        "reported_test_loss": float(reported["test-loss"]),
        "metrics": settings.metrics, "num_test": int(reported["num-examples"]),
        "epsilon_spent": float(silo.spent()), "epsilon_budget": float(silo.budget.epsilon),
        "delta": float(silo.budget.delta), "ledger_path": str(silo.ledger_path),
        "written_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def keep_evaluated_model(silo: Silo, state: dict[str, torch.Tensor], metadata: dict[str, Any],
                         run_name: int | None = None) -> Path | None:
    """Write ``state`` with ``metadata`` (:func:`evaluated_metadata`) to the run's model file,
    unless that file holds a later round or the final model; the path written, or None.
    ``run_name``: what the file is named by (the run key, kept across a resumed run; default
    the Flower run id). A failure to write is logged, not raised: the evaluation it follows
    is already charged."""
    path = model_path(silo.ledger_path, run_name or silo.run_id)
    try:
        old = read_metadata(path) if path.exists() else None
    except ValueError as exc:
        logger.warning("silo %s replaces an unreadable model file: %s",
                       metadata["partition_id"], exc)
        old = None
    if not _replaces(metadata, old):
        assert old is not None
        logger.warning("silo %s keeps the %s model of round %s in %s: the server evaluated "
                       "round %s after it", metadata["partition_id"],
                       "final" if old.get("final") else "later", old.get("round"), path,
                       metadata["round"])
        return None
    state = {key: tensor.detach().to("cpu").contiguous() for key, tensor in state.items()}
    try:
        payload = {"state_dict": state, "metadata": metadata}
        write_atomically(path, lambda handle: torch.save(payload, handle))
    except OSError as exc:
        logger.error("silo %s could not write its model to %s: %s", metadata["partition_id"],
                     path, exc)
        return None
    level = logging.INFO if metadata["final"] else logging.DEBUG
    logger.log(level, "%s", describe(path, metadata))
    return path


def describe(path: str | Path, metadata: dict[str, Any]) -> str:
    """One line for an operator: which model of which run, how good, what it cost, where."""
    which = "final model" if metadata.get("final") else (
        f"model of round {metadata.get('round')} of {metadata.get('rounds') or '?'}")
    cluster = "its own" if metadata.get("own_model") else f"cluster {metadata.get('cluster')}"
    reported = ("" if metadata.get("metrics") != "private" else
                f" (reported, noised: {metadata.get('reported_test_accuracy', 0.0):.4f})")
    return (f"silo {metadata.get('partition_id')}: {which} of run {metadata.get('run_id')} "
            f"({cluster}, test accuracy {metadata.get('test_accuracy', 0.0):.4f}{reported}, "
            f"epsilon {metadata.get('epsilon_spent', 0.0):.4g} of "
            f"{metadata.get('epsilon_budget', 0.0):g}) in {path}")


__all__ = ["FORMAT", "SUFFIX", "SiloModel", "describe", "evaluated_metadata",
           "keep_evaluated_model", "load_silo_model", "model_files", "model_path",
           "read_metadata"]
