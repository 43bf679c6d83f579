"""A tour of dtensor_lite on 4 CPU processes: a 2x2 mesh, uneven shards, redistribute plans.

Run it with either of::

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 examples/demo_redistribute.py
    python examples/demo_redistribute.py          # spawns the 4 processes itself

Every rank runs the same program; only rank 0 prints. Each step checks itself: a redistribute
must give back exactly the original tensor, CommDebugMode must measure exactly the bytes that
the plan promised, and a Linear layer on DTensors must match plain torch.

``main()`` only needs an initialised 4-rank process group, so tests can call it directly
(``tests/test_docs.py`` does, on the test harness's worker pool).
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from rich.columns import Columns
from rich.console import Console, Group
from rich.rule import Rule
from rich.table import Table
from rich.text import Text

try:
    import dtensor_lite  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dtensor_lite import (DeviceMesh, DTensor, Partial, Replicate, Shard, _StridedShard,
                          distribute_module, distribute_tensor, explain_redistribute,
                          init_device_mesh)
from dtensor_lite.debug import CommDebugMode

WORLD_SIZE = 4
RANK_STYLES = ("bold white on blue", "bold black on green", "bold white on magenta",
               "bold black on yellow")


# ----------------------------------------------------------------------------- pictures
def _gather_pieces(x: DTensor) -> list[torch.Tensor]:
    """Every rank's local piece, on every rank (a demo helper; not how you'd move real data)."""
    pieces = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, x.to_local().detach())
    return pieces


def _owners(x: DTensor, pieces: list[torch.Tensor]) -> list[list[list[int]]]:
    """owners[i][j] = the ranks holding element (i, j) of a 2-D DTensor.

    The global tensors of this demo hold ``arange``, so each value *is* its flat index: the
    picture is read off the data the ranks really hold, not recomputed from the placements.
    """
    rows, cols = x.shape
    owners = [[[] for _ in range(cols)] for _ in range(rows)]
    for rank, piece in enumerate(pieces):
        for v in piece.flatten().tolist():
            owners[int(v) // cols][int(v) % cols].append(rank)
    return owners


def sharding_picture(x: DTensor, pieces: list[torch.Tensor], title: str) -> Table:
    """A grid of the global tensor whose cells show (and are coloured by) the owning ranks."""
    owners = _owners(x, pieces)
    t = Table(title=title, header_style="dim", box=None, padding=(0, 0))
    t.add_column("", style="dim", justify="right")
    for j in range(x.shape[1]):
        t.add_column(str(j), justify="center")
    for i, row in enumerate(owners):
        cells = []
        for ranks in row:
            style = RANK_STYLES[ranks[0]] if len(ranks) == 1 else ""  # several owners: replicated
            cells.append(Text(f" {','.join(map(str, ranks)) or '-'} ", style=style))
        t.add_row(f"{i} ", *cells)
    return t


def pieces_table(x: DTensor, pieces: list[torch.Tensor], coords: list[list[int]]) -> Table:
    """Rank, mesh coordinate, local shape and the global rows/cols of each rank's piece."""
    t = Table(title=f"local pieces of {tuple(x.shape)} as {_fmt(x.placements)}")
    for col in ("rank", "(dp, tp)", "local shape", "global rows", "global cols"):
        t.add_column(col)
    cols = x.shape[1]
    for rank, piece in enumerate(pieces):
        if piece.numel() == 0:
            rows_txt = cols_txt = "(empty shard)"
        else:
            rows_txt = _span(int(piece[:, 0].min()) // cols, int(piece[:, 0].max()) // cols)
            cols_txt = _span(int(piece[0].min()) % cols, int(piece[0].max()) % cols)
        t.add_row(Text(str(rank), style=RANK_STYLES[rank]), str(tuple(coords[rank])),
                  str(tuple(piece.shape)), rows_txt, cols_txt)
    return t


def _span(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"{lo}..{hi}"


def _fmt(placements) -> str:
    return "[" + ", ".join(str(p) for p in placements) + "]"


# ----------------------------------------------------------------------------- checked steps
def checked_redistribute(x: DTensor, mesh: DeviceMesh, placements, original: torch.Tensor):
    """Redistribute ``x`` and check it three ways; return (result, plan table and its checks)."""
    plan = explain_redistribute(x, mesh, placements)     # the plan, without running it
    with CommDebugMode() as comm:
        y = x.redistribute(mesh, placements)
    # what actually crossed the wire is exactly what the plan promised, on every rank
    assert comm.get_total_bytes() == plan.rank_cost, (comm.get_comm_bytes(), str(plan))
    assert comm.get_total_counts() == plan.num_collectives, (comm.get_comm_counts(), str(plan))
    assert tuple(y.placements) == tuple(placements)
    # and the global tensor did not change
    assert torch.equal(y.full_tensor(), original), f"{_fmt(placements)}: full_tensor() differs"

    table = plan.table()
    table.title = f"{_fmt(x.placements)} -> {_fmt(y.placements)}"
    counts = ", ".join(f"{k} x{v}" for k, v in sorted(comm.get_comm_counts().items())) or "none"
    # below the table, not as its caption: a caption wraps at the table's width (a lone ✓)
    checks = Text(f"CommDebugMode: {counts}, {comm.get_total_bytes()} B = plan ✓\n"
                  "full_tensor() == original ✓")
    return y, Group(table, checks)


def linear_forward_backward(mesh: DeviceMesh):
    """A Linear layer with data parallelism on "dp" and column-sharded weights on "tp"."""
    torch.manual_seed(0)
    reference = nn.Linear(6, 5)                 # 5 output features: uneven over tp (3 + 2)
    inputs = torch.randn(7, 6)                  # batch of 7: uneven over dp (4 + 3)

    layer = nn.Linear(6, 5)
    layer.load_state_dict(reference.state_dict())

    def shard_columns(name, module, mesh):
        if isinstance(module, nn.Linear):      # weight (out, in) and bias (out,) split on "out"
            for pname in ("weight", "bias"):
                param = getattr(module, pname)
                module.register_parameter(pname, nn.Parameter(
                    distribute_tensor(param.detach(), mesh, [Replicate(), Shard(0)])))

    distribute_module(layer, mesh, shard_columns)
    x = distribute_tensor(inputs, mesh, [Shard(0), Replicate()])

    with CommDebugMode() as comm:
        out = layer(x)
        loss = out.pow(2).mean()
        loss.backward()

    expected = reference(inputs)
    expected_loss = expected.pow(2).mean()
    expected_loss.backward()
    assert torch.allclose(out.full_tensor(), expected, atol=1e-6), "forward differs from torch"

    t = Table(title=f"nn.Linear(6, 5) on a (7, 6) input {_fmt(x.placements)}")
    for col in ("tensor", "placements", "grad placements", "max |diff| vs torch"):
        t.add_column(col)
    for name, value, ref in (("output", out, expected), ("loss", loss, expected_loss)):
        t.add_row(name, _fmt(value.placements), "",
                  f"{(value.full_tensor() - ref).abs().max().item():.1e}")
    for name, param in layer.named_parameters():
        ref_grad = getattr(reference, name).grad
        grad = param.grad.full_tensor()
        assert torch.allclose(grad, ref_grad, atol=1e-5), f"{name}.grad differs from torch"
        t.add_row(name, _fmt(param.placements), _fmt(param.grad.placements),
                  f"{(grad - ref_grad).abs().max().item():.1e}")
    counts = ", ".join(f"{k} x{v}" for k, v in sorted(comm.get_comm_counts().items()))
    return Group(t, Text(f"loss = out.pow(2).mean(); collectives in forward + backward: "
                         f"{counts or 'none'}\noutput, loss and gradients match plain torch ✓"))


# ----------------------------------------------------------------------------- the tour
def main(console: Console | None = None) -> None:
    """Run the tour on an initialised process group of 4 ranks; rank 0 prints to ``console``."""
    if not dist.is_initialized() or dist.get_world_size() != WORLD_SIZE:
        raise RuntimeError(f"demo_redistribute.main() needs an initialised process group of "
                           f"{WORLD_SIZE} ranks (run it with torchrun --nproc-per-node "
                           f"{WORLD_SIZE}, or with plain python to spawn them)")
    rank = dist.get_rank()
    if rank == 0 and console is None:
        console = Console()

    def show(*renderables):
        if rank == 0:
            for r in renderables:
                console.print(r)

    # 1. The mesh: ranks [[0, 1], [2, 3]], named dims, slices and a flattened view.
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    flat = mesh.flatten("dp_tp")                 # one dim over all 4 ranks, in mesh order
    info = [None] * WORLD_SIZE
    dist.all_gather_object(info, (mesh.get_coordinate(), mesh["dp"].mesh.tolist(),
                                  mesh["tp"].mesh.tolist(), flat.get_local_rank()))
    coords = [c for c, *_ in info]
    show(Rule("1 · DeviceMesh"))
    t = Table(title="mesh = init_device_mesh('cpu', (2, 2), mesh_dim_names=('dp', 'tp'))")
    for col in ("rank", "coordinate", "mesh['dp'] ranks", "mesh['tp'] ranks",
                "rank in flat mesh"):
        t.add_column(col)
    for r, (coord, dp_ranks, tp_ranks, flat_rank) in enumerate(info):
        t.add_row(Text(str(r), style=RANK_STYLES[r]), str(tuple(coord)), str(dp_ranks),
                  str(tp_ranks), str(flat_rank))
    t.caption = f"mesh.mesh = {mesh.mesh.tolist()}: a 'tp' group is a row, a 'dp' group a column"
    show(t)

    # 2. Who holds what. 7 x 5 divides evenly by nothing here: shards follow torch.chunk.
    show(Rule("2 · Sharding pictures (uneven: 7 x 5 on a 2 x 2 mesh)"))
    original = torch.arange(35.0).reshape(7, 5)
    x = distribute_tensor(original, mesh, [Shard(0), Shard(1)])
    pictures = []
    # The last two split rows on both mesh dims; the order differs: "dp" first (the default),
    # or "tp" first -- spelled _StridedShard as in PyTorch (FSDP on top of TP needs it).
    for placements in ([Shard(0), Shard(1)], [Shard(1), Shard(0)], [Shard(0), Shard(0)],
                       [_StridedShard(0, split_factor=2), Shard(0)]):
        y = distribute_tensor(original, mesh, placements)
        pictures.append(sharding_picture(y, _gather_pieces(y), _fmt(placements)))
    show(Columns(pictures, padding=(0, 3)),
         "[dim]each cell shows the rank holding that element; _S(0,2) is\n"
         "_StridedShard(0, split_factor=2): tp splits the rows first, then dp[/dim]\n")
    show(pieces_table(x, _gather_pieces(x), coords))

    # torch.chunk(5 rows, 4) gives pieces of 2, 2, 1 -- so the fourth rank holds an empty shard.
    v_original = torch.arange(10.0).reshape(5, 2)
    v = distribute_tensor(v_original, flat, [Shard(0)])
    sizes = [p.shape[0] for p in _gather_pieces(v)]
    assert sizes == [2, 2, 1, 0], sizes
    show(f"\n(5, 2) as [S(0)] on mesh.flatten('dp_tp'): rows per rank {sizes}\n"
         "torch.chunk semantics: rank 3 holds an empty (0, 2) shard")

    # 3. Redistribute: every plan is computed first, shown, run, and checked.
    show(Rule("3 · redistribute, with the plan and the measured communication"))
    for note, placements in [
        ("gather the dp shards: one all_gather on mesh dim 0", [Replicate(), Shard(1)]),
        ("swap which mesh dim splits which tensor dim", [Shard(1), Shard(0)]),
        ("everything to everyone: tp must be undone before dp", [Replicate(), Replicate()]),
    ]:
        _, table = checked_redistribute(x, mesh, placements, original)
        show(f"[bold]{note}[/bold]", table, "")

    # Replicate -> Partial is free and keeps the global value; Partial -> Shard reduce-scatters.
    replicated = distribute_tensor(original, mesh, [Replicate(), Replicate()])
    partial, table = checked_redistribute(replicated, mesh, [Partial("sum"), Replicate()],
                                          original)
    dp_coord = mesh.get_local_rank("dp")
    assert torch.equal(partial.to_local(), original if dp_coord == 0 else torch.zeros(7, 5))
    show("[bold]Replicate -> Partial(sum): dp coordinate 1 now holds zeros, the sum is unchanged"
         "[/bold]", table, "")
    _, table = checked_redistribute(partial, mesh, [Shard(0), Replicate()], original)
    show("[bold]Partial(sum) -> Shard(0): reduce and split in one reduce_scatter[/bold]", table, "")
    _, table = checked_redistribute(v, flat, [Replicate()], v_original)
    show("[bold]the (5, 2) tensor with an empty shard: pad to equal chunks, gather, trim[/bold]",
         table, "")

    # 4. Autograd through the dispatcher: a Linear layer, compared with plain torch.
    show(Rule("4 · nn.Linear forward + backward on DTensors"))
    show(linear_forward_backward(mesh))
    show("\n[green]all checks passed on every rank[/green]")


# ----------------------------------------------------------------------------- launchers
def _spawned_worker(rank: int, world_size: int, port: int) -> None:
    torch.set_num_threads(1)  # 4 processes on a small machine: don't oversubscribe the cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    try:
        main()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    if "RANK" in os.environ:          # launched by torchrun: one process per rank already
        dist.init_process_group("gloo")
        try:
            main()
        finally:
            dist.destroy_process_group()
    else:                             # plain `python`: start the 4 ranks ourselves
        import torch.multiprocessing as mp
        mp.spawn(_spawned_worker, args=(WORLD_SIZE, _free_port()), nprocs=WORLD_SIZE)
