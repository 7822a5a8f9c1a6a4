"""Silos that answer from a script: what R-DPCFL and the baselines are driven with in tests."""

from __future__ import annotations

import numpy as np
from flwr.app import Message, MetricRecord, RecordDict

from dpcfl_flwr.methods.base import INITIAL
from dpcfl_flwr.protocol import (
    ARRAYS,
    MAJORITY,
    METRICS,
    OWN,
    SELECT,
    SILO,
    UPDATE,
    ModelLayout,
    WireModel,
    cluster_key,
    model_records,
    one_record,
    pack,
)

TRUTH = [0, 0, 1, 1, 1, 2, 2, 2]  # topology {2, 3, 3}
NODE = 1000  # node ids are 1000 + partition, to keep them apart from partitions
CLASSES = 10  # the run config's default num-classes


class ScriptedSilo:
    """Round 1: an update near its true cluster's centre. Later: a small push along its own
    coordinate, so cluster models become recognisable; it selects the model strongest on it."""

    def __init__(self, partition: int, layout: ModelLayout, centres: np.ndarray) -> None:
        self.partition, self.layout, self.centres = partition, layout, centres
        self.rng = np.random.default_rng(partition)
        self.received: list[Message] = []

    def __call__(self, message: Message) -> Message:
        kind = message.metadata.message_type
        if kind == "query":
            return self._reply(message, RecordDict({SILO: MetricRecord({
                "partition-id": self.partition, "true-cluster": TRUTH[self.partition],
                "num-train": 100, "epsilon-budget": 10.0, "delta": 1e-4,
                "epsilon-spent": 0.0})}))
        config = message.content.config_records["config"]
        if kind == "evaluate":
            own = self._score(model_records(message.content).get(ARRAYS))
            # ten test records of class 0 (and none of the others), all right or all wrong
            return self._reply(message, RecordDict({METRICS: MetricRecord({
                "test-accuracy": float(own), "test-loss": 1.0, "num-examples": 10,
                "class-correct": [10.0 * own] + [0.0] * (CLASSES - 1),
                "class-count": [10.0] + [0.0] * (CLASSES - 1), "metrics-noise-std": 0.0,
                "epsilon-spent": 1.0, "cluster": int(config["cluster"])})}))
        return self._train(message, int(config["cluster"]))

    def _score(self, model: WireModel | None) -> int:
        if model is None:  # evaluating its own model (Local)
            return 1
        vector = self.layout.flatten(model)
        return int(np.argmax(vector[:3]) == TRUTH[self.partition])

    def _train(self, message: Message, cluster: int) -> Message:
        records = model_records(message.content)
        if cluster == MAJORITY:  # nothing trained: it names the class it predicts
            assert not records  # no weights reach the silo
            self.received.append(message)
            return self._reply(message, one_record(METRICS, {
                "cluster": MAJORITY, "selected": 1, "num-examples": 100,
                "noise-multiplier": 0.0, "epsilon-spent": 0.1,
                "majority-class": TRUTH[self.partition]}))
        selected = cluster == SELECT
        if selected:
            scores = [self.layout.flatten(records[cluster_key(m)])[TRUTH[self.partition]]
                      for m in range(sum(k.startswith("cluster-") for k in records))]
            cluster = int(np.argmax(scores))
        self.received.append(message)
        update = np.zeros(self.layout.size, dtype=np.float32)
        if cluster == INITIAL:
            update = self.centres[TRUTH[self.partition]] + self.rng.normal(
                0, 0.01, self.layout.size).astype(np.float32)
        else:
            update[TRUTH[self.partition]] = 1.0
        metrics = {"cluster": cluster, "selected": int(selected), "num-examples": 100,
                   "val-loss": 1.0, "val-accuracy": 0.5, "epsilon-spent": 1.0,
                   "noise-multiplier": 1.2}
        if int(message.content.config_records["config"]["personal"]):
            if cluster == OWN:
                assert ARRAYS not in records  # Local: no weights reach the silo after round 1
            return self._reply(message, one_record(METRICS, metrics))
        return self._reply(message, one_record(METRICS, metrics, {UPDATE: pack(update)}))

    @staticmethod
    def _reply(message: Message, content: RecordDict) -> Message:
        return Message(content, reply_to=message)
