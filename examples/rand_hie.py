"""Real records with a natural split into silos: the RAND Health Insurance Experiment.

The experiment enrolled families at six sites (the ``site`` column, 1..6) and recorded, for
each person and year, their plan, health and spending. The file ships inside the statsmodels
wheel on PyPI (version 0.15.0: ``statsmodels/datasets/randhie/src/randhie.csv``, 20,190
person-years; the data are in the public domain), so it is installed like any package and
never downloaded at run time. This script writes it as one CSV file per site, the way six
silos would each hold their own table, with the federation's schema and a run config:

  python examples/rand_hie.py OUT_DIR [--sites 1,2,3,4,5,6] [--seed 0]

Task: does the person rate their own health excellent (``hlthe`` = 1; the file's ``hlthg``,
``hlthf``, ``hlthp`` are good / fair / poor, so excellent is none of them: 55% of
person-years)? From 15 features of plan, health measures and household (all numbers; the
binary ones kept as 0/1). The self-rating's own columns are the label, so they are not
features; nor is ``ghindx``, the general health perceptions index (a scale of questions about
the same perceived health, and missing for every person of site 1), nor any spending or
visit count or identifier. The experiment's own outcome, any medical spending that year
(``binexp``, 78% of person-years), was this example's label before: no model, private or
not, beats always answering "yes" on it by more than a point (bench/RESULTS.md), while
self-rated health is predictable from the features (a logistic regression: about 68%
against 54%). Sites 5 and 6 differ from 1-4 (fewer people in excellent health, 44-46%
against 54-62%, and a model of their own fits them better), so the sites form two groups:
``clusters = "4,2"`` labels them for the evaluation.

Each person appears up to five times (one row a year). The split is drawn by person, so no
person is in both training and test of a silo (the ``split`` column). The privacy unit of
DP-SGD is a record, here one person-year: a person's five years together are protected at
group privacy of size 5 (docs/own-data.md#what-a-record-is).

The schema's means and scales are the federation's choice, fixed in this file from the
variables' documented ranges and rounded; no silo computes or sends statistics of its records.
"""

from __future__ import annotations

import argparse
import csv
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import numpy as np

#: Where the records are inside the installed statsmodels distribution.
DATA_FILE = "statsmodels/datasets/randhie/src/randhie.csv"

#: The features, in order, with the federation's standardisation (mean, scale); binary
#: features are kept as 0/1.
FEATURES: tuple[tuple[str, float, float], ...] = (
    ("logc", 2.4, 2.0),      # log(coinsurance rate + 1)
    ("idp", 0.0, 1.0),       # individual deductible plan (0/1)
    ("lpi", 4.7, 2.7),       # log annual participation incentive
    ("fmde", 4.0, 3.5),      # log maximum dollar expenditure
    ("physlm", 0.0, 1.0),    # physical limitation (0/1)
    ("disea", 11.0, 7.0),    # number of chronic diseases
    ("linc", 8.7, 1.2),      # log family income
    ("lfam", 1.25, 0.5),     # log family size
    ("educdec", 12.0, 3.0),  # years of schooling of the household head
    ("xage", 26.0, 17.0),    # age in years
    ("female", 0.0, 1.0),
    ("child", 0.0, 1.0),
    ("fchild", 0.0, 1.0),    # female child
    ("black", 0.0, 1.0),
    ("mhi", 77.0, 12.5),     # mental health index (0-100)
)
#: The label: self-rated health excellent (1) or not (0).
LABEL = "hlthe"
#: The file's columns of the other self-ratings (good, fair, poor): excellent is none of them.
RATINGS = ("hlthg", "hlthf", "hlthp")
SITES = (1, 2, 3, 4, 5, 6)
#: The evaluation's groups of sites (the method never sees them): 1-4 and 5-6.
GROUPS = {1: 0, 2: 0, 3: 0, 4: 0, 5: 1, 6: 1}
TEST_FRACTION = 0.2


def data_file() -> Path:
    """The CSV inside the installed statsmodels 0.15.0 (found without importing it)."""
    try:
        path = Path(str(distribution("statsmodels").locate_file(DATA_FILE)))
    except PackageNotFoundError:
        raise SystemExit("statsmodels is not installed: pip install statsmodels==0.15.0 "
                         "(its wheel carries the records)") from None
    if not path.exists():
        raise SystemExit(f"{path} is missing: statsmodels 0.15.0 ships it (earlier versions "
                         "have no site column)")
    return path


def excellent(row: dict[str, str]) -> int:
    """The label of one row of the file: 1 if the person rated their health excellent."""
    return int(not any(float(row[name]) for name in RATINGS))


def features_schema() -> str:
    """The schema's ``features`` value (docs/own-data.md#a-silos-table-data-source--table)."""
    return ", ".join(f"{name}:number({mean:g},{scale:g})" for name, mean, scale in FEATURES)


def export(out_dir: Path, sites: tuple[int, ...] = SITES, seed: int = 0) -> list[Path]:
    """One CSV per site in ``out_dir`` (``site-<k>.csv``: the features, the label and the
    ``split`` column, drawn by person with ``seed``), the federation's ``schema.toml`` and a
    simulation run config ``run.toml``; returns the CSV paths in silo order (the sites of
    group 0, then of group 1, so that ``clusters`` labels them)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    sites = tuple(sorted(sites, key=lambda site: (GROUPS[site], site)))
    with data_file().open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    people = sorted({row["zper"] for row in rows})
    rng = np.random.default_rng(seed)
    tested = set(rng.choice(people, size=int(TEST_FRACTION * len(people)), replace=False))
    columns = [name for name, _, _ in FEATURES] + [LABEL, "split"]
    paths = []
    for site in sites:
        path = out_dir / f"site-{site}.csv"
        with path.open("w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(columns)
            for row in rows:
                if int(float(row["site"])) != site:
                    continue
                split = "test" if row["zper"] in tested else "train"
                writer.writerow([row[name] for name, _, _ in FEATURES]
                                + [excellent(row), split])
        paths.append(path)
    schema = (f'features = "{features_schema()}"\nnum-classes = 2\nlabel-column = "{LABEL}"\n'
              '# educdec is missing for 4 person-years: filled with its schema mean\n'
              'missing-values = "fill"\n')
    (out_dir / "schema.toml").write_text(schema)
    groups = [GROUPS[s] for s in sites]
    sizes = [groups.count(g) for g in sorted(set(groups))]
    (out_dir / "run.toml").write_text(
        f"# The RAND HIE sites as silos, in simulation (examples/rand_hie.py)\n{schema}"
        f'data-source = "table"\nsplit-column = "split"\n'
        f'silo-data-paths = "{",".join(str(p.resolve()) for p in paths)}"\n'
        f'clusters = "{",".join(map(str, sizes))}"\nmodel = "mlp"\n')
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--sites", default=",".join(map(str, SITES)))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    sites = tuple(int(s) for s in args.sites.split(","))
    for path in export(args.out_dir, sites, args.seed):
        print(path)


if __name__ == "__main__":
    main()
