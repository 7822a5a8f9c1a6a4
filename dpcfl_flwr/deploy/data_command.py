"""``dpcfl data check``: a silo operator looks at their own records, on their own machine,
before joining a federation: can the silo read them, what do they look like, and do they fit
the federation's schema (docs/own-data.md)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from ..config.config_file import load_schema
from ..config.settings import ConfigError, SiloConfig
from ..data.readers import DataError
from ..data.schema import Schema
from .silo_file import deployed_settings, load_silo_file
from .supervision import console, stop

data_app = typer.Typer(help="A silo's own records.", no_args_is_help=True)

#: Stand-ins for the budget keys a records check does not need (it spends nothing).
_NOT_NEEDED = {"epsilon": 1.0, "delta": 1e-5, "ledger_path": "unused-ledger.json"}


@data_app.command("check")
def check(
    silo_file: Path = typer.Argument(..., exists=True, dir_okay=False,
                                     help="The silo's file (clients/<name>.toml)."),
    schema_file: Path = typer.Option(
        None, "--schema", exists=True, dir_okay=False,
        help="The federation's schema: a TOML file of its run-config keys (input-shape, "
             "num-classes, features, ...), or a whole run config; default: the silo file's "
             "schema-file."),
) -> None:
    """Read this silo's records as `dpcfl client` would and show, here only, what they look
    like and whether they fit the federation's schema. Exit 2 if they cannot be read or do
    not fit."""
    from ..data.scaling import scaled_inputs  # noqa: PLC0415
    from ..data.summary import summarise  # noqa: PLC0415
    from ..silo.silo import client_records  # noqa: PLC0415 (torch, once flags parse)

    try:
        _, node = load_silo_file(silo_file, {"name": silo_file.stem}, {})
        node = node.model_copy(update={key: value for key, value in _NOT_NEEDED.items()
                                       if not getattr(node, key)})
        settings = deployed_settings(node)
        path = schema_file or (Path(settings.schema_file) if settings.schema_file else None)
        schema = load_schema(path) if path else None
        data = client_records(settings, schema)
        if schema is not None:  # the values the model will see (docs/own-data.md#input-scaling)
            data = scaled_inputs(data, schema, settings.data_source or "")
    except (ConfigError, DataError, ValueError, OSError) as exc:
        stop([str(exc)])
        return
    where = f"records {settings.data_path or settings.dataset}"
    summary = summarise(data, schema, where)
    table = Table(title=f"{silo_file}: {settings.data_source} {where} (shown here only)",
                  show_header=False)
    table.add_row("records (train / val / test)",
                  " / ".join(str(summary.counts[s]) for s in ("train", "val", "test")))
    table.add_row("one record's shape", "x".join(map(str, summary.record_shape)))
    table.add_row("training records per class",
                  ", ".join(f"{c}: {n}" for c, n in enumerate(summary.class_counts)))
    low, high, mean = summary.value_range
    table.add_row("input values as the model sees them (min / max / train mean)",
                  f"{low:.4g} / {high:.4g} / {mean:.4g}")
    table.add_row("schema", str(path) if path else "none given: shape and classes not checked")
    table.add_row("fits the schema", "n/a" if schema is None
                  else "yes" if summary.problem is None else "no (below)")
    said = summary.warnings + _adjustments(settings, schema)
    table.add_row("warnings", "\n".join(said) or "none")
    console.print(table)
    if summary.problem is not None:
        stop([summary.problem])


def _adjustments(settings: SiloConfig, schema: Schema | None) -> list[str]:
    """An image folder's images the reader converts or resizes, as warnings (none for other
    sources, or without a schema to compare with)."""
    if settings.data_source != "image-folder" or schema is None:
        return []
    from ..data.image_folder import adjusted_images  # noqa: PLC0415 (Pillow, once flags parse)

    converted, resized = adjusted_images(Path(settings.data_path or "."), schema)
    channels, height, width = schema.input_shape
    said = []
    if converted:
        said.append(f"{converted} images converted to {channels} channel(s): the model sees "
                    "them so, not as stored")
    if resized:
        said.append(f"{resized} images resized to {height} x {width}: check the schema's "
                    "input-shape is the images' own size")
    return said
