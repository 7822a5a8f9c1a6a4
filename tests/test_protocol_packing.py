"""Models travel as one packed Array: fewer Flower objects per message, same weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, RecordDict
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

from dpcfl_flwr.models import build_model
from dpcfl_flwr.protocol import ModelLayout, pack, pack_state, unpack_state


def cnn_state() -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in build_model("cnn", seed=3).state_dict().items()}


def test_packed_state_round_trips_exactly() -> None:
    state = cnn_state()
    back = unpack_state(pack_state(state), state)
    assert list(back) == list(state)
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name


def test_server_layout_reads_packed_and_named_records_alike() -> None:
    state = cnn_state()
    named = ArrayRecord({k: Array(v.numpy()) for k, v in state.items()})
    layout = ModelLayout.of(named)
    vector = layout.flatten(named)
    np.testing.assert_array_equal(layout.flatten(pack(vector)), vector)
    np.testing.assert_array_equal(layout.flatten(pack_state(state)), vector)
    with pytest.raises(ValueError, match="28938"):
        layout.flatten(pack(vector[:-1]))


def test_unpacking_a_wrong_size_names_both_sizes() -> None:
    state = cnn_state()
    with pytest.raises(ValueError, match="28937.*28938|28938.*28937"):
        unpack_state(pack(np.zeros(28937, dtype=np.float32)), state)


def test_named_records_still_unpack() -> None:
    state = cnn_state()
    named = ArrayRecord({k: Array(v.numpy()) for k, v in state.items()})
    back = unpack_state(named, state)
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_packing_cuts_the_objects_flower_moves_per_message() -> None:
    # Flower pushes and pulls every Array and every ArrayChunk as its own object (one request
    # each, signed and verified with node authentication): 4 candidate CNNs as named tensors
    # are 54 objects, packed 14.
    state = cnn_state()
    named = RecordDict({f"cluster-{m}": ArrayRecord({k: Array(v.numpy() + m)
                                                     for k, v in state.items()})
                        for m in range(4)})
    packed = RecordDict({f"cluster-{m}": pack_state({k: v + m for k, v in state.items()})
                         for m in range(4)})
    assert len(get_all_nested_objects(named)) == 53
    assert len(get_all_nested_objects(packed)) == 13
