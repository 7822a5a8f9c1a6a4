"""No answer of a deployed silo depends on one record unless it is a DP release.

A server writes the run config, whose schema (features and their categories, label column,
class names, number of classes, missing-values rule, input shape, image normalisation) it
could vary to probe single records: a schema that leaves out a category one record holds was
refused where its neighbour's was answered. Here, for every source (a CSV table, an image
folder, ``.npz`` arrays and an installed plug-in), two silos hold neighbouring datasets
(the same records but one, both passing the silo's pinned schema), and Hypothesis varies
every schema-bearing run-config key: the two silos' replies to query, train and evaluate
must be the same (status, error code and text, every field but the DP releases: the update
and the noised test metrics), and a refusal leaves the ledger empty.
"""

from __future__ import annotations

import tempfile
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pytest
from flwr.app import Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from dpcfl_flwr.protocol import METRICS, SILO, UPDATE, metrics_of
from tests.test_data_sources import _install_plugin
from tests.test_malicious_server import Attacker, _node_config, _run_config

#: Records a silo holds: few, so that a training round costs little.
RECORDS = 24


@dataclass(frozen=True)
class Source:
    """A data source's pinned schema (run-config keys, as the silo's schema file gives
    them), the model trained on it, and a writer of a dataset whose record 0 is the target
    (``target``: True in one neighbour, False in the other)."""

    name: str
    schema: dict[str, Any]
    write: Callable[[Path, bool], Path]


def _table(root: Path, target: bool) -> Path:
    rng = np.random.default_rng(0)
    diag = ["A" if i % 2 else "B" for i in range(RECORDS)]
    diag[0] = "C" if target else "A"  # the one record a probing schema would single out
    age = [f"{v:.1f}" for v in rng.normal(50, 10, RECORDS)]
    age[1] = "" if target else "51.0"  # a missing value, allowed by the pinned rule (fill)
    table = pa.table({"id": [f"p{i}" for i in range(RECORDS)], "age": age, "diag": diag,
                      "label": ["yes" if i % 3 else "no" for i in range(RECORDS)]})
    pa_csv.write_csv(table, root / "site.csv")
    return root / "site.csv"


def _images(root: Path, target: bool) -> Path:
    rng = np.random.default_rng(1)
    for index in range(RECORDS):
        name = "rare" if index == 0 and target else ("a" if index % 2 else "b")
        (root / "scans" / name).mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (8, 8), dtype=np.uint8)).save(
            root / "scans" / name / f"{index:03d}.png")
    return root / "scans"


def _arrays(root: Path, target: bool) -> Path:
    rng = np.random.default_rng(2)
    y = np.arange(RECORDS) % 3
    y[0] = 9 if target else 0  # the highest label of the pinned ten classes
    np.savez(root / "records.npz", x=rng.normal(size=(RECORDS, 1, 8, 8)).astype(np.float32),
             y=y)
    return root / "records.npz"


#: A plug-in source that reads the same arrays through its own code.
PLUGIN = """
    import numpy as np
    import torch
    from dpcfl_flwr.data.partition import ClientData

    def load(request):
        arrays = np.load(request.path)
        x, y = torch.from_numpy(arrays["x"]), torch.from_numpy(arrays["y"]).long()
        return ClientData(request.client_id, -1, x[:16], y[:16], x[16:18], y[16:18],
                          x[18:], y[18:])
"""

SOURCES = {
    "table": Source("table", {"features": "age:number(50,10), diag:category(A|B|C)",
                              "label-column": "label", "class-names": "no,yes",
                              "num-classes": 2, "missing-values": "fill"}, _table),
    "image-folder": Source("image-folder", {"input-shape": "1,8,8", "num-classes": 3,
                                            "class-names": "a,b,rare", "image-mean": "0.5",
                                            "image-std": "0.25"}, _images),
    "arrays": Source("arrays", {"input-shape": "1,8,8", "num-classes": 10}, _arrays),
    "oracle-plugin": Source("oracle-plugin", {"input-shape": "1,8,8", "num-classes": 10},
                            _arrays),
}

#: What a probing server may write into each schema-bearing run-config key.
SCHEMA_VARIANTS = {
    "features": st.sampled_from(["age:number(50,10), diag:category(A|B)",
                                 "age:number(50,10), diag:category(A|B|C)",
                                 "age:number, diag:category(A|B|C)",
                                 "diag:category(A|B|C), age:number(50,10)",
                                 "id:category(p0|p1), age:number"]),
    "label-column": st.sampled_from(["label", "diag", "id"]),
    "class-names": st.sampled_from(["", "no,yes", "a,b", "a,b,rare", "a,b,c"]),
    "num-classes": st.integers(2, 12),
    "missing-values": st.sampled_from(["refuse", "fill"]),
    "input-shape": st.sampled_from(["1,8,8", "64", "8,8", "1,4,16", "4"]),
    "image-mean": st.sampled_from(["", "0.5", "0.4"]),
    "image-std": st.sampled_from(["", "0.25", "1"]),
}


#: The probes that singled out one record before silos pinned their schema: a category, a
#: missing value, a class folder and a label out of range.
KNOWN_PROBES = [{"features": "age:number(50,10), diag:category(A|B)"},
                {"missing-values": "refuse"},
                {"class-names": "a,b", "num-classes": 2},
                {"num-classes": 9}]


def _silo(root: Path, source: Source, target: bool, run: dict[str, Any]) -> Attacker:
    """A deployed silo of ``source``'s neighbour ``target``, pinned to its schema, that a
    server with run config ``run`` (schema keys over the pinned ones) speaks to."""
    root.mkdir(parents=True)
    path = source.write(root, target)
    (root / "schema.toml").write_text("".join(f"{k} = {v!r}\n".replace("'", '"')
                                              for k, v in source.schema.items()))
    node = _node_config(root, **{"data-source": source.name, "data-path": str(path),
                                 "schema-file": str(root / "schema.toml"),
                                 "ignore-columns": "id", "noise-seed": 3})
    for key in ("clusters", "samples-per-client", "test-samples", "val-fraction"):
        node.pop(key)
    silo = Attacker(root, node, _run_config(root, model="mlp", **source.schema))
    # the probing keys go in as sent, whether or not they make a valid run config
    silo.context.run_config = {**silo.context.run_config, **run}
    return silo


def _comparable(reply: Message) -> tuple:
    """What a reply says apart from DP releases: status and error, or its fields without
    the update and the (noised, charged) test metrics."""
    if reply.has_error():
        return ("error", reply.error.code, reply.error.reason)
    released = {UPDATE, "test-loss", "test-accuracy", "class-correct", "class-count",
                "score-histogram"}
    numbers = {name: {k: v for k, v in metrics_of(reply, name).items() if k not in released}
               for name in (SILO, METRICS) if name in reply.content}
    return ("reply", numbers)


def _exchange(silo: Attacker) -> list[tuple]:
    return [_comparable(silo.query()), _comparable(silo.train(1, cluster=-2, **{"batch-size": 8})),
            _comparable(silo.evaluate(1))]


@pytest.fixture(scope="module", autouse=True)
def _plugin_installed():
    with tempfile.TemporaryDirectory() as root, pytest.MonkeyPatch.context() as patch:
        _install_plugin(Path(root), textwrap.dedent(PLUGIN), name="oracle-plugin")
        patch.syspath_prepend(root)
        yield


@pytest.mark.parametrize("source", list(SOURCES))
@settings(max_examples=20, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(run=st.one_of(st.sampled_from(KNOWN_PROBES),
                     st.fixed_dictionaries({}, optional=SCHEMA_VARIANTS)))
def test_neighbouring_records_get_the_same_replies_whatever_the_schema(
        source, run, server_task_identity):
    with tempfile.TemporaryDirectory() as tmp:
        silos = [_silo(Path(tmp) / str(target), SOURCES[source], target, run)
                 for target in (False, True)]
        replies = [_exchange(silo) for silo in silos]
        assert replies[0] == replies[1]
        for silo, answers in zip(silos, replies, strict=True):
            if answers[1][0] == "error":  # a refused train round charged nothing
                assert not silo.ledger_path.exists() or not silo.ledger().entries


@pytest.mark.parametrize("source", list(SOURCES))
def test_the_pinned_schema_itself_trains_both_neighbours(source, tmp_path,
                                                          server_task_identity):
    """The check above is not vacuous: under the pinned schema both neighbours answer every
    message, and what they release differs only in DP releases."""
    silos = [_silo(tmp_path / str(target), SOURCES[source], target, {})
             for target in (False, True)]
    replies = [_exchange(silo) for silo in silos]
    assert all(kind == "reply" for kind, *_ in replies[0]), replies[0]
    assert replies[0] == replies[1]
    assert all(len(silo.ledger().entries) >= 2 for silo in silos)  # trained and evaluated


@pytest.mark.parametrize(("run", "key"), [
    ({"features": "age:number(50,10), diag:category(A|B)"}, "features"),
    ({"label-column": "id", "features": "age:number(50,10), diag:category(A|B|C)"},
     "label-column"),
    ({"missing-values": "refuse"}, "missing-values"),
])
def test_a_probing_schema_is_refused_by_key_with_nothing_read(run, key, tmp_path,
                                                               server_task_identity):
    silo = _silo(tmp_path / "silo", SOURCES["table"], True, run)
    (tmp_path / "silo" / "site.csv").unlink()  # the refusal cannot depend on the records
    reply = silo.query()
    assert reply.has_error() and "from this silo's pinned schema" in reply.error.reason
    assert key in reply.error.reason.partition(" differ")[0]
    assert not silo.ledger_path.exists()


def test_an_ignored_column_is_never_trained_on(tmp_path, server_task_identity, caplog):
    pinned = {**SOURCES["table"].schema,
              "features": "age:number(50,10), diag:category(A|B|C), id:category(p0|p1)"}
    silo = _silo(tmp_path / "silo", Source("table", pinned, _table), False, {})
    reply = silo.query()
    assert reply.has_error() and "id" not in reply.error.reason
    assert "'id' is in the silo's ignore-columns" in caplog.text
