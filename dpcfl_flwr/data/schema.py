"""The federation's data schema: what every silo's records must look like (docs/own-data.md).

The server sets it in the run config; every silo builds its records to it and checks itself
against it before anything is trained or charged. It holds no statistic of any silo's records:
normalisation constants are the federation's choice (or absent), never computed from records
and sent.

A table's features are one string of the run config, in column order (Flower's run config is
a flat mapping whose order is not kept, so the order is written in the value)::

    age:number(54,9), bp:number, sex:category(f|m), smoker:category(no|yes)

``number`` is used as ``(value - mean) / scale`` (``number`` alone: mean 0, scale 1);
``category(a|b|c)`` becomes one indicator per listed value. The model's input is the
concatenation, so its width is the number of numbers plus the number of listed categories.
A name with a range ``{first..last}`` stands for one column per integer, in order:
``px{0..783}:number(0.5,0.25)`` is the 784 pixel columns ``px0`` .. ``px783``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal

#: How a table's missing values are handled: ``refuse`` (the silo's records are refused) or
#: ``fill`` (a missing number becomes its feature's schema mean, a missing category every
#: indicator 0). Both use only the schema, never the silo's other records, so one record's
#: features never depend on another's (which would break per-record DP).
MISSING_RULES = ("refuse", "fill")

_FEATURE = re.compile(r"^\s*([^:()|,\s][^:()|,]*?)\s*:\s*(number|category)\s*(?:\(([^()]*)\))?\s*$")


@dataclass(frozen=True)
class Feature:
    """One column of a table: a number (standardised with the schema's mean and scale) or a
    category (one indicator per listed value)."""

    name: str
    kind: Literal["number", "category"]
    categories: tuple[str, ...] = ()
    mean: float = 0.0
    scale: float = 1.0

    @property
    def width(self) -> int:
        """Model inputs this feature becomes."""
        return len(self.categories) if self.kind == "category" else 1


#: A column range in a feature's name: ``px{0..783}``.
_RANGE = re.compile(r"\{(\d+)\.\.(\d+)\}")
#: Most columns a schema string may name: a run config is the server's text, and a silo
#: parses it before anything else, so a range cannot make it build millions of features.
MAX_FEATURES = 100_000


def _expanded(parts: list[str]) -> list[str]:
    """``parts`` with each column range written out, one part per column (at most
    :data:`MAX_FEATURES` in all); ValueError for a range that runs backwards."""
    out: list[str] = []
    for part in parts:
        name, colon, rest = part.partition(":")
        found = _RANGE.search(name)
        if found is None:
            out.append(part)
            continue
        first, last = int(found.group(1)), int(found.group(2))
        if last < first:
            raise ValueError(f"feature {name.strip()!r}: the range runs backwards")
        if len(out) + last - first + 1 > MAX_FEATURES:
            raise ValueError(f"the features name more than {MAX_FEATURES:,} columns")
        out += [f"{name[:found.start()]}{i}{name[found.end():]}{colon}{rest}"
                for i in range(first, last + 1)]
    return out


def parse_features(text: str) -> tuple[Feature, ...]:
    """The features of a schema string (module docstring); ValueError naming the part that is
    wrong."""
    features: list[Feature] = []
    for part in _expanded(_split_top_level(text)):
        match = _FEATURE.match(part)
        if not match:
            raise ValueError(f"feature {part.strip()!r}: expected 'name:number', "
                             "'name:number(mean,scale)' or 'name:category(a|b|...)'")
        name, kind, arguments = match.group(1), match.group(2), match.group(3)
        if kind == "category":
            values = tuple(v.strip() for v in (arguments or "").split("|"))
            if arguments is None or len(values) < 2 or "" in values:
                raise ValueError(f"feature {name!r}: a category lists at least two values, "
                                 "e.g. category(f|m)")
            if len(set(values)) != len(values):
                raise ValueError(f"feature {name!r}: a category value is listed twice")
            features.append(Feature(name, "category", values))
            continue
        mean, scale = 0.0, 1.0
        if arguments is not None:
            try:
                mean, scale = (float(v) for v in arguments.split(","))
            except ValueError:
                raise ValueError(f"feature {name!r}: number(mean,scale) takes two numbers, "
                                 f"got ({arguments})") from None
            if not (math.isfinite(mean) and math.isfinite(scale) and scale > 0):
                raise ValueError(f"feature {name!r}: mean must be finite and scale positive")
        features.append(Feature(name, "number", mean=mean, scale=scale))
    if not features:
        raise ValueError("no features listed")
    names = [f.name for f in features]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"feature {repeated[0]!r} is listed twice")
    return tuple(features)


def _split_top_level(text: str) -> list[str]:
    """``text`` split at commas outside parentheses (``number(54,9)`` stays whole)."""
    parts, depth, current = [], 0, ""
    for char in text:
        depth += (char == "(") - (char == ")")
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return [p for p in parts if p.strip()]


def parse_floats(text: str) -> tuple[float, ...]:
    """``"0.5"`` or ``"0.49,0.48,0.45"`` as finite floats; empty text: ()."""
    if not text.strip():
        return ()
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"{text!r} is not a comma-separated list of numbers") from None
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"{text!r}: every value must be finite")
    return values


#: How an image folder's or arrays' records are scaled where the schema gives no image-mean
#: and image-std (:class:`Schema`).
INPUT_SCALINGS = ("per-record", "none")


@dataclass(frozen=True)
class Schema:
    """What every silo's records look like.

    - ``input_shape``: one record as the model sees it (an image ``(C, H, W)``, a table's
      ``(width,)``, or its features laid out in a shape of as many values);
    - ``num_classes``: labels are 0 .. C-1; ``class_names`` (optional) names them, in order,
      as an image folder's sub-folders or a table's label values;
    - ``features``, ``label``, ``missing``: a table's columns in order, its label column and
      the rule for missing values (:data:`MISSING_RULES`);
    - ``image_mean``, ``image_std``: per-channel normalisation after pixels are scaled to
      [0, 1] (one value for every channel, or one per channel; empty: none);
    - ``input_scaling``: where image-mean / image-std are not given, what an image folder's
      or arrays' records go through before the model sees them (:data:`INPUT_SCALINGS`):
      ``per-record``, each record to mean 0 and standard deviation 1 over its own values,
      so that one learning rate serves records stored in any range (0..255 pixels, [0, 1],
      already standardised), or ``none``, as read (docs/own-data.md#input-scaling).
    """

    input_shape: tuple[int, ...]
    num_classes: int
    class_names: tuple[str, ...] = ()
    features: tuple[Feature, ...] = ()
    label: str = "label"
    missing: str = "refuse"
    image_mean: tuple[float, ...] = ()
    image_std: tuple[float, ...] = ()
    input_scaling: str = "per-record"

    def __post_init__(self) -> None:
        if self.class_names and len(self.class_names) != self.num_classes:
            raise ValueError(f"class-names lists {len(self.class_names)} names for "
                             f"{self.num_classes} classes")
        if self.features and math.prod(self.input_shape) != self.feature_width:
            raise ValueError(f"input-shape {','.join(map(str, self.input_shape))} does not "
                             f"match the features' width {self.feature_width}")
        if self.missing not in MISSING_RULES:
            raise ValueError(f"missing-values must be one of {', '.join(MISSING_RULES)}")
        channels = self.input_shape[0]
        for name, values in (("image-mean", self.image_mean), ("image-std", self.image_std)):
            if len(values) not in (0, 1, channels):
                raise ValueError(f"{name} gives {len(values)} values for {channels} channels")
        if any(v <= 0 for v in self.image_std):
            raise ValueError("image-std values must be positive")
        if bool(self.image_mean) != bool(self.image_std):
            raise ValueError("image-mean and image-std are set together")
        if self.input_scaling not in INPUT_SCALINGS:
            raise ValueError(f"input-scaling must be one of {', '.join(INPUT_SCALINGS)}")

    @property
    def feature_width(self) -> int:
        """The model input width of a table's features."""
        return sum(f.width for f in self.features)

    def class_index(self, name: str) -> int | None:
        """The label of a class named ``name`` (a listed class name, else an integer in
        range); None: not one of the schema's classes."""
        if self.class_names:
            return self.class_names.index(name) if name in self.class_names else None
        try:
            label = int(name)
        except ValueError:
            return None
        return label if 0 <= label < self.num_classes and str(label) == name.strip() else None
