"""The one table style for reports with many columns, so that they fit an 80-column terminal.

A terminal in CI or a pipe is 80 columns wide; rich cuts a header (``unshar…``) or wraps a value
(``148.36`` / ``KiB``) when a boxed table does not fit. Without vertical rules and with one space
between columns, a table of eight or nine short columns fits; its value columns are added with
``no_wrap=True`` so a number and its unit stay on one line.
"""
from __future__ import annotations

__all__ = ["compact_table"]


def compact_table(**kwargs):
    """A ``rich.table.Table`` with no vertical rules, one space between columns and the caption
    (where its legend goes) left-aligned; ``kwargs`` as ``Table``'s (title, caption, ...)."""
    from rich import box
    from rich.table import Table
    kwargs.setdefault("caption_justify", "left")
    return Table(box=box.SIMPLE_HEAD, show_edge=False, padding=0, **kwargs)
