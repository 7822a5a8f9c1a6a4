"""How fast each data source feeds DP-SGD: the same Fashion-MNIST silo records in memory (the
benchmark reader), exported as an image folder (PNG), a CSV table of 784 pixel columns, a
Parquet file, and a directory of .npy files, each loaded by its own source and trained on with
the silo's DP-SGD (the paper's CNN, Poisson batches of 32, one thread).

Per source: load seconds, and DP-SGD samples per second over an epoch after a first epoch
(so a source that reads when used has its cache warm, as in every round but the first),
interleaved over repeats; the ratio to the in-memory reader is the median of each repeat's
ratio. ``--records-memory`` (MiB) is the silo setting that makes sources whose records do not
fit read them when used (0: the setting's default, records this small are in memory).

  python bench/source_throughput.py [--records 2000] [--repeats 3] [--no-append]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import publish  # noqa: E402
from dpcfl_flwr.data import Topology, load_dataset, make_client_data  # noqa: E402
from dpcfl_flwr.data.partition import ClientData  # noqa: E402
from dpcfl_flwr.data.schema import Schema, parse_features  # noqa: E402
from dpcfl_flwr.data.sources import SPLITS, SourceRequest, load_records  # noqa: E402
from dpcfl_flwr.dpsgd.training import DPSGDConfig, train_dp  # noqa: E402
from dpcfl_flwr.models import build_model  # noqa: E402

MEAN, STD = 0.1307, 0.3081  # the benchmark's Fashion-MNIST normalisation


def export(data: ClientData, root: Path) -> dict[str, tuple[str, Path, Schema, dict]]:
    """The silo's records in every format; per source: its name, path, schema, options."""
    image_schema = Schema((1, 28, 28), 10, image_mean=(MEAN,), image_std=(STD,))
    table_schema = Schema((1, 28, 28), 10, features=parse_features(
        ", ".join(f"p{i}:number" for i in range(784))))
    columns: dict[str, list] = {f"p{i}": [] for i in range(784)}
    columns["label"], columns["part"] = [], []
    (root / "npy").mkdir(parents=True)
    for split in SPLITS:
        x, y = getattr(data, f"x_{split}").numpy(), getattr(data, f"y_{split}").numpy()
        pixels = np.rint((x * STD + MEAN) * 255).astype(np.uint8)
        for index, (image, label) in enumerate(zip(pixels, y, strict=True)):
            folder = root / "images" / split / str(label)
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(image[0]).save(folder / f"{index:05d}.png")
        for i, values in enumerate(x.reshape(len(x), 784).T):
            columns[f"p{i}"] += values.astype(np.float64).tolist()
        columns["label"] += y.tolist()
        columns["part"] += [split] * len(y)
        np.save(root / "npy" / f"x_{split}.npy", x)
        np.save(root / "npy" / f"y_{split}.npy", y)
    table = pa.table(columns)
    pa_csv.write_csv(table, root / "records.csv")
    pq.write_table(table, root / "records.parquet", row_group_size=512)
    split = {"split-column": "part"}
    return {"image-folder (PNG)": ("image-folder", root / "images", image_schema, {}),
            "table (CSV)": ("table", root / "records.csv", table_schema, split),
            "table (Parquet)": ("table", root / "records.parquet", table_schema, split),
            "arrays (.npy)": ("arrays", root / "npy", image_schema, {})}


def epoch_rate(data: ClientData) -> float:
    """DP-SGD samples per second over the second of two epochs (Poisson b = 32)."""
    model = build_model("cnn", seed=0)
    config = DPSGDConfig(1.0, 1.0, 0.01, 32)
    train_dp(model, data.x_train, data.y_train, config, round_number=2, seed=0)
    start = time.perf_counter()
    result = train_dp(model, data.x_train, data.y_train, config, round_number=3, seed=1)
    return result.sampled_examples / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--records-memory", type=float, default=0.0)
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    train, test = load_dataset("fmnist", None)
    data = make_client_data(train, test, 0, Topology((1,)), "rotation", args.records, seed=0,
                            test_samples=500)
    with tempfile.TemporaryDirectory() as tmp:
        sources = export(data, Path(tmp))
        options = {"records-memory": args.records_memory} if args.records_memory else {}
        loaded: dict[str, ClientData] = {"in memory (benchmark reader)": data}
        load_seconds: dict[str, float] = {"in memory (benchmark reader)": 0.0}
        for label, (name, path, schema, extra) in sources.items():
            start = time.perf_counter()
            request = SourceRequest(path, 0, 0, 0.25, 0.2, schema, {**extra, **options})
            loaded[label] = load_records(name, request)
            load_seconds[label] = time.perf_counter() - start
        rates: dict[str, list[float]] = {label: [] for label in loaded}
        for _ in range(args.repeats):  # interleaved: machine noise hits every source alike
            for label, records in loaded.items():
                rates[label].append(epoch_rate(records))
    base = "in memory (benchmark reader)"

    def ratio(label: str) -> float:
        return statistics.median(a / b for a, b in zip(rates[label], rates[base], strict=True))

    rows = "\n".join(
        f"| {label} | {loaded[label].num_train} | {load_seconds[label]:.2f} | "
        f"{max(rates[label]):,.0f} | {ratio(label):.2f} |" for label in loaded)
    body = (f"One silo's Fashion-MNIST records ({args.records} drawn, the quick example's "
            "split), DP-SGD on the paper's CNN, Poisson b = 32, one thread; samples/s over "
            f"the second epoch, {args.repeats} interleaved repeats. records-memory: "
            f"{args.records_memory or 'default'} MiB.\n\n"
            "| source | N_i | load (s) | samples/s (best) | / in memory (median) |\n"
            "|---|---|---|---|---|\n" + rows + "\n")
    publish("DP-SGD fed by each data source", body, append=not args.no_append)


if __name__ == "__main__":
    main()
