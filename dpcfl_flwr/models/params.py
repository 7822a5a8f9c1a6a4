"""Parameter types the built-in models share (their tables in the run config)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, PlainSerializer


def _widths(value: Any) -> Any:
    """``"64,32"`` (a run config holds no lists), a bare ``64``, ``""`` (no layer) or a list,
    as a tuple of ints; pydantic then checks each is an int."""
    if isinstance(value, bool):
        return value  # refused below: a width is not a flag
    if isinstance(value, int):
        return (value,)
    if isinstance(value, str):
        parts = [part.strip() for part in value.split(",") if part.strip()]
        try:
            return tuple(int(part) for part in parts)
        except ValueError:
            raise ValueError(f"{value!r} is not a comma-separated list of integers") from None
    return value


def _positive(value: tuple[int, ...]) -> tuple[int, ...]:
    if any(width < 1 for width in value):
        raise ValueError("every width must be a positive integer")
    return value


#: Layer widths (units or channels), written ``"64,32"`` in the run config.
Widths = Annotated[tuple[int, ...], BeforeValidator(_widths), AfterValidator(_positive),
                   PlainSerializer(lambda value: ",".join(str(width) for width in value),
                                   return_type=str)]
