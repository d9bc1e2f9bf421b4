"""What the `kvpool` commands share: reading number lists, and printing a result as a table or JSON
with the exit code its targets call for."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer


def ints(option: str, text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise typer.BadParameter(f"{text!r}: expected positive integers separated by commas", param_hint=option)
    return values


AsJson = Annotated[bool, typer.Option("--json", help="print JSON instead of a table")]
NoFail = Annotated[bool, typer.Option("--no-fail", help="exit 0 even when a target is missed")]


def emit(result: dict[str, Any], as_json: bool, table: object, no_fail: bool = False) -> None:
    """Print the result; a missed target (`pass` false) exits 1 after printing, unless `no_fail`."""
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    else:
        table_fn = table
        assert callable(table_fn)
        table_fn(result)
    if result.get("pass") is False and not no_fail:
        raise typer.Exit(1)
