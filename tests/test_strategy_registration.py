"""Which node is which silo: a partition id belongs to one connected node at a time."""

from __future__ import annotations

import numpy as np

from dpcfl_flwr.config.settings import parse_run_config
from dpcfl_flwr.protocol import ModelLayout
from dpcfl_flwr.server_app import initial_arrays
from dpcfl_flwr.strategies import build_strategy

from .grid_double import GridDouble
from .scripted_silos import NODE, TRUTH, ScriptedSilo

TWIN = 5000  # a second node that claims partition 3


def _strategy_and_grid():
    experiment = parse_run_config({"method": "global", "clusters": "2,3,3",
                                   "num-server-rounds": 2, "eval-every": 2, "out-dir": "x"})
    initial = initial_arrays(experiment)
    layout = ModelLayout.of(initial)
    centres = np.random.default_rng(0).normal(0, 1, (3, layout.size)).astype(np.float32)
    silos = {NODE + p: ScriptedSilo(p, layout, centres) for p in range(len(TRUTH))}
    silos[TWIN] = ScriptedSilo(3, layout, centres)
    return build_strategy(experiment, initial), GridDouble(silos), initial


def test_a_second_node_claiming_a_connected_silos_partition_is_refused(server_task_identity,
                                                                      caplog):
    strategy, grid, initial = _strategy_and_grid()
    strategy.discover(grid, expected=len(TRUTH), wait=5)
    assert strategy.silos[3].node_id == NODE + 3 and len(strategy.silos) == len(TRUTH)
    refusals = [r.getMessage() for r in caplog.records if "cannot start" in r.getMessage()]
    assert refusals == [f"silo on node {TWIN} cannot start: partition 3 is already node "
                        f"{NODE + 3}'s, which is still connected: two silos cannot share one "
                        "partition id"]
    strategy.start(grid, initial, 2, timeout=10)
    assert not [m for m in grid.of_type("train") if m.metadata.dst_node_id == TWIN]
    assert len(refusals) == 1  # said once, not every round


def test_a_restarted_silo_takes_its_partition_back_under_its_new_node(server_task_identity):
    strategy, grid, _ = _strategy_and_grid()
    del grid.responders[TWIN]
    strategy.discover(grid, expected=len(TRUTH), wait=5)
    grid.responders[TWIN] = grid.responders.pop(NODE + 3)  # the old node is gone
    strategy.refresh_silos(grid)
    assert strategy.silos[3].node_id == TWIN
