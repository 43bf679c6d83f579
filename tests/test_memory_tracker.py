"""dtensor_lite.debug.MemoryTracker on the memory benchmark's model (torch's DTensor test
Transformer, fully_shard per block and root, AdamW, gloo): its peak agrees with the profiler's
figure that benchmarks/memory.py reports, and its categories add up and say what they should."""
import torch

from benchmarks.memory import CONFIGS, MiB, build, profiled_step, train_step
from dtensor_lite.debug import MemoryTracker
from dtensor_lite.memory_categories import (ACTIVATIONS, CATEGORIES, OPTIMIZER_STATE,
                                            SHARDED_PARAMS, UNSHARDED_PARAMS)
from tests.harness import distributed


def _tracked_step(model, opt, tokens) -> MemoryTracker:
    with MemoryTracker(model, opt) as mem:
        train_step(model, opt, tokens)
    return mem


@distributed(world_size=2, timeout=240)
def test_tracker_peak_agrees_with_the_profiler_on_the_benchmark_model():
    cfg = next(c for c in CONFIGS if c.name == "w2_l4")
    model, opt, dp_rank = build("ours", cfg)
    g = torch.Generator().manual_seed(dp_rank)
    tokens = [torch.randint(0, 1024, (2, 129), generator=g) for _ in range(8)]
    for t in tokens[:2]:                      # warm-up: optimizer state exists from here on
        profiled_step(model, opt, t)
    profiler, tracker = [], []
    for i, t in enumerate(tokens[2:]):        # alternate, so both see the same machine load
        if i % 2:
            profiler.append(profiled_step(model, opt, t)["step"])
        else:
            mem = _tracked_step(model, opt, t)
            tracker.append(mem)
    # every step peaks alike: buffers a finished gloo collective used are released by FSDP, not
    # whenever gloo's thread drops its reference (fsdp.streams.Streams.release)
    assert len(set(profiler)) == 1, [p / MiB for p in profiler]
    peak = min(m.peak_bytes for m in tracker)
    reference = min(profiler)
    assert abs(peak - reference) <= 0.05 * reference, (peak / MiB, reference / MiB)

    mem = tracker[0]
    # the categories add up to the peak, per interval and at the peak
    assert sum(mem.peak_breakdown[k] for k in CATEGORIES) == mem.peak_bytes
    for row in mem.by_module_phase().values():
        assert sum(row[k] for k in CATEGORIES) == row["peak"]
    # steady state: no new sharded parameters or optimizer state in a step; shards lent to
    # gathered parameters (fsdp.param.FSDPParam.lend_shard) are freed meanwhile: the root's, and
    # at most two blocks' (current + prefetched)
    block_shard = sum(p.to_local().nbytes for p in model.layers[0].parameters())
    root_shard = sum(p.to_local().nbytes for n, p in model.named_parameters()
                     if not n.startswith("layers"))
    assert -(root_shard + 2 * block_shard) <= mem.peak_breakdown[SHARDED_PARAMS] <= -root_shard
    assert mem.peak_breakdown[OPTIMIZER_STATE] == 0
    assert mem.at_start[OPTIMIZER_STATE] == 2 * mem.at_start[SHARDED_PARAMS] + 4 * sum(
        1 for _ in model.parameters())  # exp_avg, exp_avg_sq and a float32 step per parameter
    # gathered parameters: at most two blocks (current + prefetched) and the root
    block = sum(p.numel() for p in model.layers[0].parameters()) * 4
    root = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("layers")) * 4
    for row in mem.by_module_phase().values():
        assert row[UNSHARDED_PARAMS] <= 2 * block + root + 64 * 8  # + padding of 8 params
    phases = mem.by_phase()
    assert set(phases) == {"forward", "backward", "optimizer"}
    assert phases["forward"][ACTIVATIONS] > 0
    assert "layers.0" in {module for module, _ in mem.by_module_phase()}
    mem.table()  # renders


def test_memory_profile_silences_only_its_own_calls_and_restores_the_thresholds():
    """The profiler runs (the block's allocation is in its events) with c10's warnings held back
    inside the block only, and both loggers' thresholds are as they were afterwards."""
    from dtensor_lite.quiet_profiler import _c10_threshold, _kineto_threshold, memory_profile

    c10, kineto = _c10_threshold(), _kineto_threshold()
    assert c10 is not None and kineto is not None, "torch no longer exports the log thresholds"
    with memory_profile():  # the first profiler of a process starts kineto, which sets its own
        pass
    before = c10.value, kineto.value
    kept = torch.ones(1)
    with memory_profile() as prof:
        assert c10.value == max(2, before[0])   # WARNING and below dropped, ERROR still shown
        del kept                                # allocated before: the allocator would warn
        made = torch.empty(12345, dtype=torch.uint8)
    assert (c10.value, kineto.value) == before
    sizes = [e.extra_fields.alloc_size for e in _walk(prof.profiler.kineto_results)
             if e.name == "[memory]"]
    assert made.untyped_storage().nbytes() in sizes


def _walk(results):
    stack = list(results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        yield e
