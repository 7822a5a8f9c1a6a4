"""A silo whose records are several times larger than its memory trains to completion.

The records are ``--factor`` times larger than a memory cap: with ``--source npy`` (the
default) a directory of ``.npy`` files (``x.npy`` float32 records, ``y.npy`` labels), with
``--source parquet`` one Parquet file of row groups (a float32 column a pixel of a 1 x 28 x 28
record, ``p0`` ... ``p783``, and a ``label`` column), read by the table source with the
schema's input shape and a ``records-memory`` of an eighth of the cap. The silo runs in a
child process confined to the cap by a cgroup (v1 memory controller: the page cache of the
records it reads counts against the cap, and is reclaimed under it): it loads its records as a
deployed silo does (split drawn, values checked in one pass), runs the full-batch round 1 (one
pass, chunk by chunk), a Poisson round and a test evaluation, exactly the calls a silo's round
makes. Reported: the data size against the cap, the cgroup's peak usage and the process's peak
resident set, whether the kernel killed it (OOM), and the wall time of each phase.

The table source spools a table larger than its records-memory to the silo's disk as float32
records when it starts (the conversion pass), and a step reads its records from the spool. The
Parquet records are many small ones (a full Poisson epoch at b = 1024 is 1,670 steps), so its
Poisson round is timed over ``PARQUET_POISSON_STEPS`` steps of records drawn over the whole
file.

A control run reads the same records into memory (``np.load`` without memory-mapping; for
Parquet, a ``records-memory`` larger than the records) under the same cap, and must be killed:
otherwise the cap was not binding.

  python bench/larger_than_memory.py [--source npy|parquet] [--cap-mib 1024] [--factor 5]
                                     [--dir /tmp/big] [--no-append]

Needs root and a cgroup v1 memory controller at /sys/fs/cgroup/memory (it says so and stops
otherwise). The records file is kept in --dir for a rerun (delete it afterwards: it is
--factor x --cap-mib large).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import publish  # noqa: E402

CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
RECORD_SHAPE = (3, 64, 64)  # 48 KiB a record: few records, so a round has few steps
BATCH = 1024
#: Parquet records: one column a value, so a smaller record (784 columns, 3 KiB).
PARQUET_SHAPE = (1, 28, 28)
PARQUET_GROUP_ROWS = 8192  # 24.5 MiB a row group
#: The lazily read silo's records-memory (its cache of converted row groups): cap / 8.
PARQUET_CACHE_SHARE = 8
PARQUET_POISSON_STEPS = 20
PARQUET_FILE = "records.parquet"


def write_records(directory: Path, size_bytes: int, seed: int = 0) -> int:
    """``x.npy`` of float32 records (RECORD_SHAPE) adding up to ``size_bytes``, written in
    blocks through a memory map (never whole in memory), and ``y.npy`` labels 0..9. Reuses
    files of the right size. Returns the number of records."""
    per_record = 4 * int(np.prod(RECORD_SHAPE))
    count = size_bytes // per_record
    directory.mkdir(parents=True, exist_ok=True)
    x_path, y_path = directory / "x.npy", directory / "y.npy"
    if x_path.exists() and np.load(x_path, mmap_mode="r").shape[0] == count:
        return count
    rng = np.random.default_rng(seed)
    x = np.lib.format.open_memmap(x_path, mode="w+", dtype=np.float32,
                                  shape=(count, *RECORD_SHAPE))
    y = rng.integers(0, 10, count)
    for start in range(0, count, 2048):
        stop = min(count, start + 2048)
        block = rng.standard_normal((stop - start, *RECORD_SHAPE), dtype=np.float32)
        block[:, 0] += y[start:stop, None, None] * 0.1  # a little signal to learn
        x[start:stop] = block
    x.flush()
    del x
    np.save(y_path, y)
    return count


def write_parquet(directory: Path, size_bytes: int, seed: int = 0) -> int:
    """``records.parquet``: float32 records of PARQUET_SHAPE adding up to ``size_bytes``, a
    column a value, in row groups of PARQUET_GROUP_ROWS written one at a time (never whole in
    memory), uncompressed (random values do not compress), and labels 0..9. Reuses a file of
    the right size. Returns the number of records."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    width = int(np.prod(PARQUET_SHAPE))
    count = size_bytes // (4 * width)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / PARQUET_FILE
    if path.exists() and pq.ParquetFile(path).metadata.num_rows == count:
        return count
    names = [f"p{i}" for i in range(width)]
    schema = pa.schema([(name, pa.float32()) for name in names] + [("label", pa.int64())])
    rng = np.random.default_rng(seed)
    with pq.ParquetWriter(path, schema, compression="none", use_dictionary=False,
                          write_statistics=False) as writer:
        for start in range(0, count, PARQUET_GROUP_ROWS):
            rows = min(PARQUET_GROUP_ROWS, count - start)
            y = rng.integers(0, 10, rows)
            columns = rng.standard_normal((width, rows), dtype=np.float32)  # a column a row
            columns[: width // 4] += y * 0.1  # a little signal to learn
            writer.write_batch(pa.record_batch([*map(pa.array, columns), pa.array(y)],
                                                schema=schema))
    return count


def _records(directory: Path, source: str, in_memory: bool,  # type: ignore[no-untyped-def]
             records_mib: int):
    """The silo's records as it loads them (the control: read whole)."""
    if source == "npy":
        from dpcfl_flwr.data.arrays import load_arrays

        if in_memory:
            np.load(directory / "x.npy").sum()
        return load_arrays(directory, 0, seed=0, val_fraction=0.01, test_fraction=0.05)
    from dpcfl_flwr.data.schema import Schema, parse_features
    from dpcfl_flwr.data.sources import SourceRequest
    from dpcfl_flwr.data.table import load_table

    features = parse_features(", ".join(f"p{i}:number" for i in range(
        int(np.prod(PARQUET_SHAPE)))))
    schema = Schema(PARQUET_SHAPE, 10, features=features, label="label")
    memory = 2**20 if in_memory else records_mib  # the control: all in memory
    return load_table(SourceRequest(directory / PARQUET_FILE, 0, 0, 0.01, 0.05, schema,
                                    {"records-memory": memory}))


def silo_child(directory: Path, in_memory: bool, source: str = "npy", records_mib: int = 256
               ) -> dict[str, float]:
    """What a silo does with its records, timed (runs inside the capped cgroup)."""
    import torch
    from torch import nn

    from dpcfl_flwr.dpsgd.training import DPSGDConfig, evaluation_sums, train_dp

    torch.set_num_threads(1)
    times: dict[str, float] = {}
    start = time.perf_counter()
    data = _records(directory, source, in_memory, records_mib)
    times["load and check (s)"] = time.perf_counter() - start
    torch.manual_seed(0)
    if source == "npy":
        model = nn.Sequential(nn.Conv2d(3, 8, 8, stride=8), nn.GroupNorm(2, 8), nn.ReLU(),
                              nn.Flatten(), nn.Linear(8 * 8 * 8, 10))
        poisson = (f"round 2, Poisson b={BATCH} (s)", data.x_train, data.y_train)
    else:
        model = nn.Sequential(nn.Conv2d(1, 8, 4, stride=4), nn.GroupNorm(2, 8), nn.ReLU(),
                              nn.Flatten(), nn.Linear(8 * 7 * 7, 10))
        spread = np.sort(np.random.default_rng(0).choice(
            data.num_train, PARQUET_POISSON_STEPS * BATCH, replace=False))
        poisson = (f"round 2, {PARQUET_POISSON_STEPS} Poisson steps b={BATCH} (s)",
                   data.x_train.subset(spread), data.y_train[spread])
    for name, batch, round_number, x, y in (
            ("round 1, full batch (s)", "full", 1, data.x_train, data.y_train),
            (poisson[0], BATCH, 2, poisson[1], poisson[2])):
        start = time.perf_counter()
        config = DPSGDConfig(1.0, 1.0, 0.5, batch, physical_batch_size=256)
        train_dp(model, x, y, config, round_number=round_number, seed=1)
        times[name] = time.perf_counter() - start
    start = time.perf_counter()
    _, correct = evaluation_sums(model, data.x_test, data.y_test)
    times["test evaluation (s)"] = time.perf_counter() - start
    times["records"] = data.num_train + len(data.y_val) + len(data.y_test)
    times["test accuracy"] = correct / len(data.y_test)
    times["peak resident set (MiB)"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return times


def evict(path: Path) -> None:
    """Drop ``path``'s pages from the page cache, so the capped silo reads them itself and
    they count against its cap (pages cached by the writer stay charged to the writer)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
        os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(descriptor)


def capped_run(directory: Path, cap_bytes: int, in_memory: bool, source: str
               ) -> dict[str, object]:
    """Run :func:`silo_child` in a fresh cgroup capped at ``cap_bytes``; its figures and the
    cgroup's."""
    group = CGROUP_ROOT / f"dpcfl-bench-{os.getpid()}-{int(in_memory)}"
    group.mkdir()
    evict(directory / ("x.npy" if source == "npy" else PARQUET_FILE))
    try:
        (group / "memory.limit_in_bytes").write_text(str(cap_bytes))
        swap = group / "memory.memsw.limit_in_bytes"
        if swap.exists():
            swap.write_text(str(cap_bytes))
        code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).parents[1])!r}); "
                "from bench.larger_than_memory import silo_child; from pathlib import Path; "
                f"print(json.dumps(silo_child(Path({str(directory)!r}), {in_memory}, {source!r}, "
                f"{cap_bytes // 2**20 // PARQUET_CACHE_SHARE})))")
        script = (f'echo $$ > {group}/cgroup.procs && exec "{sys.executable}" -c "$0"')
        start = time.perf_counter()
        child = subprocess.run(["sh", "-c", script, code], capture_output=True, text=True,
                               timeout=7200)
        wall = time.perf_counter() - start
        figures: dict[str, object] = {
            "exit": child.returncode, "wall (s)": wall,
            "cgroup peak (MiB)": int((group / "memory.max_usage_in_bytes").read_text())
            / 2**20,
            "oom kills": _oom_kills(group)}
        if child.returncode == 0:
            figures.update(json.loads(child.stdout.strip().splitlines()[-1]))
        else:
            figures["error"] = (child.stderr.strip().splitlines() or ["killed"])[-1][:200]
        return figures
    finally:
        for _ in range(50):  # the killed child may take a moment to leave the group
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def _oom_kills(group: Path) -> int:
    for line in (group / "memory.oom_control").read_text().splitlines():
        if line.startswith("oom_kill "):
            return int(line.split()[1])
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", choices=("npy", "parquet"), default="npy")
    parser.add_argument("--cap-mib", type=int, default=1024)
    parser.add_argument("--factor", type=float, default=5.0)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/dpcfl-larger-than-memory"))
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args()
    if os.geteuid() != 0 or not (CGROUP_ROOT / "memory.limit_in_bytes").exists():
        sys.exit(f"needs root and a cgroup v1 memory controller at {CGROUP_ROOT}")
    cap = args.cap_mib * 2**20
    if args.source == "npy":
        count = write_records(args.dir, int(args.factor * cap))
        size, shape = (args.dir / "x.npy").stat().st_size, RECORD_SHAPE
        stored = ".npy"
    else:
        count = write_parquet(args.dir, int(args.factor * cap))
        size, shape = (args.dir / PARQUET_FILE).stat().st_size, PARQUET_SHAPE
        stored = (f"Parquet, row groups of {PARQUET_GROUP_ROWS} records, records-memory "
                  f"{args.cap_mib // PARQUET_CACHE_SHARE} MiB")
    lazy = capped_run(args.dir, cap, in_memory=False, source=args.source)
    control = capped_run(args.dir, cap, in_memory=True, source=args.source)
    rows = "\n".join(f"| {key} | {_show(lazy.get(key))} | {_show(control.get(key))} |"
                     for key in dict.fromkeys([*lazy, *control]))
    body = (f"{count} records of {shape} float32 ({size / 2**30:.2f} GiB of {stored}) "
            f"under a cgroup memory cap of {args.cap_mib} MiB (page cache included; the records "
            f"are {size / cap:.1f}x the cap). "
            "Read when used: the silo's own loading, a full-batch round, a Poisson round "
            f"(b = {BATCH}) and a test evaluation. Control: the same silo reading its "
            "records whole first.\n\n"
            f"| figure | read when used | read whole (control) |\n|---|---|---|\n{rows}\n")
    stored = ".npy" if args.source == "npy" else "Parquet"
    publish(f"A silo's records larger than its memory ({stored})", body,
            append=not args.no_append)


def _show(value: object) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    main()
