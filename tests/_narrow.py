"""Checks that a rich table fits a narrow terminal: nothing cut, nothing wider, no value broken."""
from __future__ import annotations

import io

WIDTH = 80  # a terminal in CI or a pipe


def render(renderable, width: int = WIDTH) -> str:
    """``renderable`` as rich prints it on a terminal ``width`` columns wide (plain text)."""
    from rich.console import Console
    console = Console(width=width, record=True, file=io.StringIO(), color_system=None)
    console.print(renderable)
    return console.export_text()


def assert_text_fits(text: str, what: str, width: int = WIDTH) -> None:
    """No header or cell cut short (rich's ``…``) and no line wider than ``width``."""
    assert "…" not in text, f"{what}: something is cut at {width} columns:\n{text}"
    wide = [line for line in text.splitlines() if len(line.rstrip()) > width]
    assert not wide, f"{what}: lines wider than {width} columns:\n" + "\n".join(wide)


def assert_table_fits(table, width: int = WIDTH) -> str:
    """``assert_text_fits``, and every cell of a ``no_wrap`` column (a value: ``148.36 KiB``)
    whole on one line. Returns the rendered text."""
    text = render(table, width)
    what = f"table {str(table.title)!r}"
    assert_text_fits(text, what, width)
    lines = text.splitlines()
    for column in table.columns:
        if column.no_wrap:
            for cell in column._cells:
                plain = getattr(cell, "plain", str(cell))
                assert any(plain in line for line in lines), \
                    f"{what}: {plain!r} of column {column.header!r} is broken:\n{text}"
    return text
