"""Every table the library and the main example print fits an 80-column terminal.

Piped or in CI a terminal is 80 columns wide, and rich then cuts headers (``unshar…``) or breaks
values (``148.36`` / ``KiB``). Each table is rendered at 80 columns (``tests/_narrow.py``): nothing
cut, no line wider, every value whole on one line. Tables are built from the real objects where one
process can (a memory tracker, a dry run on a fake world) and from rows of the widest realistic
values otherwise. demo_redistribute's output is checked by tests/test_docs.py the same way.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from examples import train_llama_screens as screens
from tests._narrow import assert_table_fits

ALL_DIMS = {"pp": 16, "dp_replicate": 8, "dp_shard": 16, "tp": 8}


def test_memory_tracker_tables_fit():
    from dtensor_lite.debug import MemoryTracker
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters())
    with MemoryTracker(model, opt) as tracker:
        model(torch.randn(32, 64)).sum().backward()
        opt.step()
    for per_module in (False, True):
        text = assert_table_fits(tracker.table(per_module=per_module))
        assert "optim: optimizer state" in text  # the short headers' legend


def test_example_tables_fit_with_every_mesh_dim():
    assert_table_fits(screens.mesh_table("cpu", 1024, ALL_DIMS))
    # the example's widest: 12 layers (pp=4 x 3 stages), the feed-forward weights
    names = ("tok_embeddings.weight", "layers.11.feed_forward.w2.weight")
    rows = [{"name": name, "global": "(256, 160)", "local": "(128, 160)",
             "cells": {"pp": "3", "dp_replicate": "R", "dp_shard": "S(0)*", "tp": "S(1)"}}
            for name in names]
    text = assert_table_fits(screens.parameter_table(rows, ALL_DIMS))
    assert all(name in text for name in names), text  # names whole, not folded
    assert "pp: the pipeline rank whose stage holds the parameter" in text
    per_rank = [{"rank": r, "step_s": 12.3456, "exposed_comm_s": 10.5, "comm_in_flight_s": 99.9,
                 "peak_memory_bytes": 123_456 * 2**20} for r in (0, 1023)]
    for device in ("cpu", "cuda"):
        text = assert_table_fits(screens.rank_table(per_rank, device))
        assert "exposed % of step:" in text  # the hint on whether the share is expected
    bubbles = [{"pp_rank": 15, "measured": 0.731, "analytical": 0.2}] * 4
    text = assert_table_fits(screens.bubble_table(bubbles, "zero-bubble", 32, "cpu"))
    assert "includes the waits for sends and receives" in text


def test_parameter_rows_of_every_stage_come_in_model_order():
    """The pp screen lists every stage's parameters, tok_embeddings before layers.*."""
    from examples.llama import Llama, LlamaConfig
    from examples.train_llama_pp import LocalStages
    from dtensor_lite.plan.presets import EXAMPLE
    model = Llama(LlamaConfig(**{**EXAMPLE, "n_layers": 2}))
    order = [name for name, _ in model.named_parameters()]
    first = LocalStages([])  # stage 0: embeddings and layer 0; stage 1: layer 1, norm, output
    first.tok_embeddings, first.layers["0"] = model.tok_embeddings, model.layers[0]
    last = LocalStages([])
    last.layers["1"], last.norm, last.output = model.layers[1], model.norm, model.output
    sizes = {"pp": 2, "dp_shard": 2}
    stages = [screens.parameter_rows(mod, sizes, pp_rank) for pp_rank, mod in
              enumerate((last, first))]  # gathered in any order
    merged = sorted((row for stage in stages for row in stage),
                    key=lambda row: order.index(row["name"]))
    assert [row["name"] for row in merged] == order
    assert {row["cells"]["pp"] for row in merged if row["name"].startswith("layers.1.")} == {"0"}


def test_dry_run_tables_fit_with_a_pipeline():
    from dtensor_lite.plan import dry_run
    from examples.train_llama import TrainConfig, dry_run_setup, parse_args
    cfg = parse_args(["--mesh", "pp=2,dp_replicate=2,dp_shard=2,tp=2", "--layers", "2",
                      "--batch", "8", "--microbatches", "2", "--dry-run"])
    report = dry_run(dry_run_setup(cfg), {"pp": 2, "dp_replicate": 2, "dp_shard": 2, "tp": 2})
    tables = report.tables()
    assert len(tables) == 5  # memory, communication, time, and the two pipeline tables
    for table in tables:
        assert_table_fits(table)
    assert isinstance(cfg, TrainConfig)
