"""dtensor_lite: distributed tensors (DeviceMesh, placements, DTensor, redistribute).

Public names mirror ``torch.distributed.tensor`` so switching is a change of imports.
"""
from .device_mesh import DeviceMesh, init_device_mesh
from .placements import Partial, Placement, Replicate, Shard, _StridedShard
from .spec import DTensorSpec, TensorMeta
from .dtensor import DTensor
from . import ops  # noqa: F401  (registers the sharding rules)
from . import _dispatch  # noqa: F401  (installs itself as DTensor's op dispatcher)
from . import _fast_path  # noqa: F401  (DTensor's __torch_function__ shortcut; DTENSOR_LITE_FAST_PATH=0 turns it off)
from . import _local_linear  # noqa: F401  (registers the tensor-parallel linear shortcut)
from . import _tp_linear, _tp_norm  # noqa: F401  (register the shortcuts of tp's styles)
from . import _at_exit  # noqa: F401  (the process's teardown in an order that cannot abort)
from .redistribute import explain_redistribute, RedistributePlan
from .factories import (distribute_tensor, distribute_module, zeros, ones, empty, full, rand, randn,
                        linspace, logspace)
from . import checkpoint, debug, experimental, placement_types, random
from .strategy_api import local_map, register_sharding
from .primitives import (all_to_all_single, compute_local_shape_and_global_offset, ring_shift,
                         send_recv)
from .grad_norm import clip_grad_norm_, get_total_norm
from .state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                         get_state_dict, set_model_state_dict, set_optimizer_state_dict,
                         set_state_dict)

__all__ = [
    "DeviceMesh", "init_device_mesh", "Placement", "Shard", "Replicate", "Partial", "DTensor",
    "DTensorSpec", "TensorMeta", "distribute_tensor", "distribute_module", "zeros", "ones",
    "empty", "full", "rand", "randn", "linspace", "logspace", "explain_redistribute",
    "RedistributePlan", "checkpoint", "debug", "experimental", "placement_types",
    "register_sharding", "local_map",
    "ring_shift", "send_recv", "all_to_all_single", "compute_local_shape_and_global_offset",
    "StateDictOptions", "get_model_state_dict", "set_model_state_dict", "get_optimizer_state_dict",
    "set_optimizer_state_dict", "get_state_dict", "set_state_dict", "clip_grad_norm_",
    "get_total_norm",
]
__version__ = "0.1.0"
