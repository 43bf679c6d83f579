"""tp: tensor parallelism on dtensor_lite, mirroring ``torch.distributed.tensor.parallel``.

``parallelize_module(model, tp_mesh, plan)`` applies parallel styles to submodules: parameters
become DTensors sharded or replicated over the 1-D TP mesh, activations are laid out at module
boundaries by hooks. ``loss_parallel()`` computes cross-entropy on vocab-sharded logits.
See docs/tp.md.
"""
from .api import parallelize_module
from .loss import loss_parallel
from .style import (ColwiseParallel, ParallelStyle, PrepareModuleInput,
                    PrepareModuleInputOutput, PrepareModuleOutput, RowwiseParallel,
                    SequenceParallel)

__all__ = ["parallelize_module", "loss_parallel", "ParallelStyle", "ColwiseParallel",
           "RowwiseParallel", "SequenceParallel", "PrepareModuleInput", "PrepareModuleOutput",
           "PrepareModuleInputOutput"]
