"""No run config can exhaust a silo's memory: the run's model is sized on the meta device and
refused by name beyond the silo's limits before any of its tensors exists.

Each case runs a real ClientApp in a process of its own and reads the process's peak
resident memory (``ru_maxrss``) before and after the message: before these limits, an MLP of
hidden widths 12000,12000 took a silo to 925 MB for a model it then refused, and
``num-classes = 100000`` to 938 MB.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dpcfl_flwr.config.settings import parse_run_config
from dpcfl_flwr.models import ModelSpec
from dpcfl_flwr.silo.limits import STATE_COPIES, footprint

REPO = Path(__file__).resolve().parents[1]

#: The child: one deployed silo, one train message under the probing run config; prints the
#: reply's error and the peak resident memory (MiB) before and after it (the code a training
#: silo loads anyway, Opacus' included, loaded before).
CHILD = textwrap.dedent("""
    import json, resource, sys
    from pathlib import Path
    from flwr.supercore.task_identity import TaskIdentity
    from tests.test_malicious_server import Attacker, _node_config, _run_config

    root, run, node, schema = Path(sys.argv[1]), *map(json.loads, sys.argv[2:5])
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0
    if schema:
        (root / "schema.toml").write_text(schema)
        node["schema-file"] = str(root / "schema.toml")
    silo = Attacker(root, _node_config(root, **node))
    silo.context.run_config = {**silo.context.run_config, **run}
    # what any silo that trains has loaded: the code the limits use to size a model
    import opacus, dpcfl_flwr.dpsgd.training, dpcfl_flwr.silo.limits
    peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    before = peak()
    reply = silo.train(1, cluster=-2)
    print(json.dumps({"reason": reply.error.reason if reply.has_error() else None,
                      "code": reply.error.code if reply.has_error() else None,
                      "before": before, "after": peak(),
                      "ledger": silo.ledger_path.exists()}))
""")


def _probe(tmp_path: Path, run: dict, node: dict | None = None, schema: str = "") -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), json.dumps(run),
                           json.dumps(node or {}), json.dumps(schema)],
                          cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # a process of its own per case, each importing torch and Flower
@pytest.mark.parametrize(("run", "node", "schema", "words"), [
    ({"model": "mlp", "model-params.hidden": "12000,12000"}, {}, "",
     "holds 153,552,010 values; this silo builds at most 50,000,000 (node config "
     "'max-model-parameters')"),
    ({"num-classes": 100000}, {}, 'input-shape = "1,28,28"\nnum-classes = 100000\n',
     "'num-classes' = 100000 exceeds this silo's limit of 10000 (node config 'max-classes')"),
    ({"physical-batch-size": 100000}, {}, "",
     "'physical-batch-size' = 100000 exceeds this silo's limit of 4096"),
    ({"physical-batch-size": 4000}, {"max-round-memory": 512}, "",
     "this silo allows 512 MiB (node config 'max-round-memory')"),
])
def test_a_run_beyond_the_silos_limits_is_refused_before_its_model_exists(
        tmp_path, run, node, schema, words):
    result = _probe(tmp_path, run, node, schema)
    assert result["code"] == 4003 and words in result["reason"], result
    assert not result["ledger"]  # nothing charged, nothing stored
    # the refused model never existed: the message left the peak where it was
    assert result["after"] - result["before"] < 64, result


def test_the_same_limits_admit_the_papers_models():
    """The defaults refuse none of the paper's settings: the CNN on Fashion-MNIST and
    ResNet-18 (GroupNorm) on CIFAR-10, in the memory rule's physical batches."""
    for run in ({}, {"model": "resnet18", "dataset": "cifar10"}):
        spec = parse_run_config(run).model_spec
        size = footprint(spec, 0)
        assert size.peak_mib < 1024 and size.values < 12_000_000, (run, size)


def test_the_estimate_counts_the_models_values_and_a_batch_of_gradients():
    """The footprint against an independent count: the MLP 784 -> 64 -> 10 holds
    784 x 64 + 64 + 64 x 10 + 10 values, and 64 + 10 activations per record besides the
    flattened input."""
    spec = ModelSpec("mlp", 10, (1, 28, 28), (("hidden", (64,)),))
    size = footprint(spec, 100)
    values = 784 * 64 + 64 + 64 * 10 + 10
    assert (size.values, size.trainable, size.physical_batch) == (values, values, 100)
    assert size.activations >= 64 + 10
    expected = 4 * (STATE_COPIES * values + 100 * (values + 3 * size.activations)) / 2**20
    assert size.peak_mib == pytest.approx(expected)
