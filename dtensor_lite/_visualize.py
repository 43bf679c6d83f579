"""``debug.visualize_sharding``: which ranks hold which block of a 1-D or 2-D DTensor."""
from __future__ import annotations

import itertools
import sys

__all__ = ["sharding_blocks", "visualize_sharding"]


def sharding_blocks(dtensor) -> dict[tuple[tuple[int, int], ...], list[int]]:
    """``{((start, stop) per tensor dim): [global ranks]}``: the block every rank of the mesh
    holds, from metadata alone (no communication). Ranks that replicate a block share its entry;
    empty pieces (an uneven shard's trailing ranks) hold nothing and are left out."""
    spec = dtensor._spec
    mesh = spec.mesh
    blocks: dict[tuple[tuple[int, int], ...], list[int]] = {}
    for coord in itertools.product(*(range(n) for n in mesh.shape)):
        local, offset = spec.local_shape_and_offset(list(coord))
        if 0 in tuple(local):
            continue
        key = tuple((o, o + n) for o, n in zip(offset, local))
        blocks.setdefault(key, []).append(int(mesh.mesh[coord]))
    return blocks


def visualize_sharding(dtensor, header: str = "", use_rich: bool = False):
    """Print, as a table, which ranks hold which block of a 1-D or 2-D DTensor (torch's
    ``visualize_sharding``): one row per row range, one column per column range, each cell the
    devices holding that block. Printed once, by the rank at mesh coordinate 0 on every dim;
    an empty tensor prints nothing. Partial placements are named under the table: the ranks of a
    cell then hold partial values of it. ``use_rich`` is accepted for torch's signature; the
    table is always drawn with rich."""
    from rich.console import Console
    from rich.table import Table

    if dtensor.ndim not in (1, 2):
        raise ValueError(f"visualize_sharding shows 1-D and 2-D DTensors; this one has shape "
                         f"{tuple(dtensor.shape)}: view it as 2-D first (e.g. "
                         "dt.flatten(0, -2) for the leading dims)")
    mesh = dtensor.device_mesh
    coordinate = mesh.get_coordinate()
    if dtensor.numel() == 0 or coordinate is None or any(coordinate):
        return
    blocks = sharding_blocks(dtensor)
    if dtensor.ndim == 1:
        blocks = {(rows, (0, 1)): ranks for (rows,), ranks in blocks.items()}
    row_ranges = sorted({rows for rows, _ in blocks})
    col_ranges = sorted({cols for _, cols in blocks})
    table = Table(title=header or None, show_lines=True)
    table.add_column("")
    for lo, hi in col_ranges:
        table.add_column(f"col {lo}-{hi - 1}" if dtensor.ndim == 2 else "", justify="center")
    for rows in row_ranges:
        cells = [", ".join(f"{mesh.device_type}:{r}" for r in blocks.get((rows, cols), []))
                 for cols in col_ranges]
        table.add_row(f"row {rows[0]}-{rows[1] - 1}", *cells)
    console = Console(file=sys.stdout, width=120)
    console.print(table)
    partial = [f"Partial({p.reduce_op}) on mesh dim {d}"
               for d, p in enumerate(dtensor.placements) if p.is_partial()]
    if partial:
        console.print("partial values: " + "; ".join(partial), soft_wrap=True)
