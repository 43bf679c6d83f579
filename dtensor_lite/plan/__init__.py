"""Size a run before renting it: the dry run of a training step on any mesh, in one process.

``dry_run(setup, {"dp_replicate": 8, "dp_shard": 16, "tp": 8})`` builds the model on the meta
device, applies the real parallelisation on a fake world of 1,024 ranks and runs one step; the
report gives one rank's memory by category, its communication by collective and mesh dim, and
time estimates; a pipeline-parallel ``setup`` that also returns its schedule gets micro-batches
in flight, bytes per send / receive and the bubble (``pipeline.py``). ``python -m
dtensor_lite.plan --setup examples.train_llama:plan_setup --model llama3-70b --mesh ...`` does it
for the Llama shapes of ``presets.py`` (see docs/scale.md).
"""
from .cost import INTER_NODE, INTRA_NODE, ComputeModel, Link, LinkModel
from .dry_run import DATA_PARALLEL_DIMS, DryRunReport, dry_run, measure_step
from .fake_world import fake_world
from .measure import StepMeter, storage_bytes

__all__ = ["dry_run", "measure_step", "DryRunReport", "DATA_PARALLEL_DIMS", "fake_world",
           "StepMeter", "storage_bytes", "Link", "LinkModel", "ComputeModel", "INTRA_NODE",
           "INTER_NODE"]
