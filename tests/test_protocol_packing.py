"""Models travel packed, inside the message's one record while they fit in a chunk: fewer
Flower objects per message, same weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common.constant import FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents

from dpcfl_flwr.models import build_model
from dpcfl_flwr.protocol import (
    PACKED,
    ModelLayout,
    metrics_of,
    model_records,
    one_record,
    pack,
    pack_state,
    unpack_state,
)


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
    # Flower pushes and pulls every record, Array and ArrayChunk as its own object (one
    # request each, signed and verified with node authentication): 4 candidate CNNs as named
    # tensors next to the config are 54 objects below the message; packed into the config, 2
    # (the RecordDict and its one record), however many models it carries.
    state = cnn_state()
    named = RecordDict({f"cluster-{m}": ArrayRecord({k: Array(v.numpy() + m)
                                                     for k, v in state.items()})
                        for m in range(4)})
    named["config"] = ConfigRecord({"server-round": 3})
    packed = one_record("config", {"server-round": 3},
                        {f"cluster-{m}": pack_state({k: v + m for k, v in state.items()})
                         for m in range(4)})
    assert len(get_all_nested_objects(named)) == 54
    assert len(get_all_nested_objects(packed)) == 2
    assert list(packed) == ["config"]
    assert packed["config"]["server-round"] == 3
    assert sorted(model_records(packed)) == [f"cluster-{m}" for m in range(4)]
    for m in range(4):
        back = unpack_state(model_records(packed)[f"cluster-{m}"], state)
        assert all(torch.equal(back[k], state[k] + m) for k in state)


def test_a_model_may_not_take_the_place_of_a_setting() -> None:
    with pytest.raises(ValueError, match="'cluster'.*'config'"):
        one_record("config", {"cluster": 1}, {"cluster": pack(np.zeros(3, np.float32))})


def test_a_model_larger_than_one_chunk_travels_as_flowers_chunked_array() -> None:
    big = np.arange(FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE // 4 + 1, dtype=np.float32)
    record = pack(big)
    assert isinstance(record, ArrayRecord)
    assert len(record[PACKED].children or {}) == 2  # Flower cut it into two chunks
    np.testing.assert_array_equal(ModelLayout(["w"], [big.shape]).flatten(record), big)
    content = one_record("metrics", {"num-examples": 5}, {"update": record})
    assert content["update"] is record and dict(content["metrics"]) == {"num-examples": 5}
    assert model_records(content) == {"update": record}
    small = pack(big[:FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE // 4])
    assert isinstance(small, bytes)
    assert list(one_record("metrics", {}, {"update": small})) == ["metrics"]


def test_packed_bytes_are_little_endian_float32_whatever_the_sender_held() -> None:
    vector = np.linspace(-1, 1, 28938)
    packed = pack(vector.astype(">f8"))  # big-endian doubles in
    assert packed == vector.astype("<f4").tobytes()
    layout = ModelLayout.of(ArrayRecord({k: Array(v.numpy()) for k, v in cnn_state().items()}))
    out = layout.flatten(packed)
    np.testing.assert_array_equal(out, vector.astype(np.float32))
    out += 1  # the server aggregates in place: a writable copy, not a view of the message
    assert layout.flatten(packed)[0] == np.float32(-1)


def test_bytes_that_are_not_a_float32_vector_are_refused() -> None:
    state = cnn_state()
    with pytest.raises(ValueError, match="float32 bytes"):
        unpack_state(b"\x00" * 7, state)
    with pytest.raises(ValueError, match="float32 bytes or an ArrayRecord, got a list"):
        unpack_state([0.0] * 28938, state)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="float32 bytes or an ArrayRecord, got a ConfigRecord"):
        unpack_state(ConfigRecord({PACKED: b"\x00" * 8}), state)  # type: ignore[arg-type]


@pytest.mark.parametrize("size, objects",
                         [(28938, 3), (FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE // 4 + 10, 7)])
def test_a_reply_survives_flowers_own_serialisation(server_task_identity, size, objects):
    # What Flower moves: every nested object deflated to bytes, then inflated on the other
    # side. The CNN's reply is the message, its RecordDict and the one record; a model above
    # one chunk adds its ArrayRecord, the Array and two chunks.
    vector = np.random.default_rng(size).normal(size=size).astype(np.float32)
    sent = Message(one_record("metrics", {"num-examples": 3, "val-accuracy": 0.5},
                              {"update": pack(vector)}), dst_node_id=5, message_type="train")
    nested = get_all_nested_objects(sent)
    assert len(nested) == objects
    received = inflate_object_from_contents(
        sent.object_id, {key: obj.deflate() for key, obj in nested.items()},
        keep_object_contents=False)
    assert isinstance(received, Message)
    update = model_records(received.content)["update"]
    np.testing.assert_array_equal(ModelLayout(["w"], [(size,)]).flatten(update), vector)
    assert metrics_of(received)["val-accuracy"] == 0.5


@pytest.mark.parametrize("size", [28938, FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE // 4 + 10])
def test_a_checked_update_is_read_only_and_a_packed_one_is_not_copied(server_task_identity,
                                                                        size):
    """The server reads a packed update in place (a copy per silo cost ~0.45 s of round 1 at
    1,008 silos on this VM); whichever way it came, nothing may write into it."""
    from dpcfl_flwr.strategies.replies import train_reply

    vector = np.random.default_rng(size).normal(size=size).astype(np.float32)
    packed = pack(vector)
    message = Message(one_record("metrics", {"cluster": 0, "epsilon-spent": 1.0,
                                             "noise-multiplier": 1.0}, {"update": packed}),
                      dst_node_id=5, message_type="train")
    update = train_reply(message, ModelLayout(["w"], [(size,)]), 2, 1.0, 10).update
    np.testing.assert_array_equal(update, vector)
    assert not update.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        update[0] = 0.0
    if isinstance(packed, bytes):
        assert np.shares_memory(update, np.frombuffer(packed, dtype=np.uint8))
