"""The rich consoles every command prints on: stdout for answers and tables, stderr for
errors, stats and notes. rich is imported when one is made, not at start-up."""

from __future__ import annotations


def err_console():
    """A rich console on stderr (errors, stats, notes)."""
    from rich.console import Console

    return Console(stderr=True, highlight=False, soft_wrap=True)


def out_console():
    """A rich console on stdout (answers and tables)."""
    from rich.console import Console

    return Console(highlight=False, soft_wrap=True)
