"""The names of what a rank's memory holds, shared by every tool that reports memory.

``dtensor_lite.debug.MemoryTracker`` (measured) and the dry run of a parallel layout (estimated)
report the same categories, so their figures can be compared name for name.
"""
SHARDED_PARAMS = "sharded_params"      # this rank's pieces of the parameters (what the optimizer steps)
UNSHARDED_PARAMS = "unsharded_params"  # parameters gathered by FSDP for a module's compute
GRADIENTS = "gradients"                # sharded gradients (.grad) and FSDP's unsharded ones before reduction
OPTIMIZER_STATE = "optimizer_state"    # e.g. AdamW's exp_avg, exp_avg_sq, step
ACTIVATIONS = "activations"            # saved for backward, and every other temporary of the compute
COMM_BUFFERS = "comm_buffers"          # all-gather / reduce-scatter buffers of collectives in flight

CATEGORIES = (SHARDED_PARAMS, UNSHARDED_PARAMS, GRADIENTS, OPTIMIZER_STATE, ACTIVATIONS,
              COMM_BUFFERS)

# column headers short enough for a table of every category on an 80-column terminal, and the
# legend that says what each stands for
SHORT_NAMES = {SHARDED_PARAMS: "sharded", UNSHARDED_PARAMS: "unshard.", GRADIENTS: "grads",
               OPTIMIZER_STATE: "optim", ACTIVATIONS: "activ.", COMM_BUFFERS: "comm"}
LEGEND = ("sharded / unshard.: parameters as stored / gathered by FSDP for compute; grads: "
          "gradients; optim: optimizer state; activ.: activations; comm: collective buffers")

__all__ = ["CATEGORIES", "SHARDED_PARAMS", "UNSHARDED_PARAMS", "GRADIENTS", "OPTIMIZER_STATE",
           "ACTIVATIONS", "COMM_BUFFERS", "SHORT_NAMES", "LEGEND"]
