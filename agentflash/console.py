"""Printing for the command line."""

from __future__ import annotations

from typing import Any


def print_whole(table: Any) -> None:
    """Print a rich ``table`` at its natural width, even when that is wider than the terminal
    (or the 80 columns rich assumes for a pipe): a wrapped line still reads, a cell cut to "…"
    does not."""
    from rich.console import Console
    from rich.measure import Measurement

    console = Console()
    natural = Measurement.get(console, console.options.update_width(10_000), table).maximum
    Console(width=max(console.width, natural)).print(table)
