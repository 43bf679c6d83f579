"""The public surface of the installed PyTorch's DTensor, DeviceMesh, TP and FSDP modules, name by
name, against ours: each public name exists here with a compatible signature, or it is listed
below with the reason we do not provide it. Collected from the installed torch, so a torch that
adds a name makes this fail until the name is provided or listed -- and the same file passes on
every supported release (2.13 and 2.15 have different surfaces): an entry for a name that only
newer releases have also says since which one (``ADDED_IN``), so an older torch does not take it
for a stale entry.

Compatible signature: code that calls torch's with arguments that torch accepts calls ours the
same way -- every parameter of torch's is accepted here under the same name (positional ones at
the same position), one torch makes optional is optional here, and what we add is optional.
Classes: their ``__init__``, and every public method / property / class attribute that torch's
class defines itself (for DTensor: not those it inherits from torch.Tensor).
"""
import importlib
import inspect

import pytest
import torch

# torch module -> ours
MODULES = {
    "torch.distributed.tensor": "dtensor_lite",
    "torch.distributed.tensor.debug": "dtensor_lite.debug",
    "torch.distributed.tensor.experimental": "dtensor_lite.experimental",
    "torch.distributed.tensor.parallel": "tp",
    "torch.distributed.tensor.placement_types": "dtensor_lite.placement_types",
    "torch.distributed.device_mesh": "dtensor_lite.device_mesh",
    "torch.distributed.fsdp": "fsdp",
}

_FSDP1 = ("FSDP1 (FullyShardedDataParallel, the wrapper class) and its configuration: we "
          "implement FSDP2's fully_shard only, which torch recommends over FSDP1")
# (torch module, name) -> why we do not provide it
NOT_PROVIDED = {
    ("torch.distributed.tensor.experimental", "context_parallel"):
        "context parallelism is built on the placement API instead "
        "(examples/strategies/ring_attention.py, docs/strategies.md)",
    **{("torch.distributed.fsdp", name): _FSDP1 for name in (
        "BackwardPrefetch", "CPUOffload", "FullOptimStateDictConfig", "FullStateDictConfig",
        "FullyShardedDataParallel", "LocalOptimStateDictConfig", "LocalStateDictConfig",
        "MixedPrecision", "OptimStateDictConfig", "OptimStateKeyType",
        "ShardedOptimStateDictConfig", "ShardedStateDictConfig", "ShardingStrategy",
        "StateDictConfig", "StateDictSettings", "StateDictType")},
}

# (torch class name, member) -> why ours lacks it or differs
MEMBERS_NOT_PROVIDED = {
    ("FSDPModule", "set_custom_all_gather"):
        "torch's hook for replacing FSDP's all-gather implementation (symmetric memory, "
        "custom kernels); ours always goes through dtensor_lite.collectives",
    ("FSDPModule", "set_custom_reduce_scatter"): "as set_custom_all_gather",
    ("FSDPModule", "set_symm_mem_for_comm"): "symmetric memory (CUDA/NVSHMEM) is not used here",
    ("FSDPModule", "set_allocate_memory_from_process_group_for_comm"):
        "NCCL memory-pool allocation for comm buffers is not used here",
    ("FSDPModule", "set_reduce_scatter_max_input_buffers"):
        "ours keeps one reduce-scatter in flight per root (see docs/fsdp.md)",
    ("FSDPModule", "set_separate_reduce_scatter_group"):
        "one process group per mesh dim here; reduce-scatters share it",
}

# list entry key -> the torch release that added the name, for entries about names that the
# oldest supported release (2.13) lacks, e.g. {("FSDPModule", "some_2_15_method"): "2.15"}
ADDED_IN: dict[tuple[str, str], str] = {}


def _installed_release() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def _newer_than_installed(key) -> bool:
    release = ADDED_IN.get(key)
    return release is not None and \
        tuple(int(x) for x in release.split(".")) > _installed_release()


# members torch defines as class-level properties that ours sets per instance in __init__
INSTANCE_ATTRIBUTES = {"DeviceMesh": {"device_type", "mesh", "mesh_dim_names", "ndim"}}

# (torch module, name or "Class.member") -> why the signatures may differ
SIGNATURE_DIFFERENCES = {
    ("torch.distributed.device_mesh", "DeviceMesh"):
        "ours needs ``mesh`` (torch's builds a default from its internal layout arguments) "
        "and takes backend overrides through init_device_mesh / _unflatten",
}


def _public_names(module) -> list[str]:
    return list(getattr(module, "__all__", None)
                or [n for n in dir(module) if not n.startswith("_")])


def _pairs():
    out = []
    for torch_name, ours_name in MODULES.items():
        module = importlib.import_module(torch_name)
        out += [(torch_name, ours_name, n) for n in _public_names(module)]
    return out


PAIRS = _pairs()


def _signature(obj):
    try:
        return inspect.signature(obj)
    except (TypeError, ValueError):  # builtins without a Python signature
        return None


def _incompatibility(theirs: inspect.Signature, ours: inspect.Signature) -> str | None:
    """Why a call that torch's signature accepts may fail with ours, or None."""
    P = inspect.Parameter
    t_params = [p for p in theirs.parameters.values() if p.name != "self"]
    o_params = [p for p in ours.parameters.values() if p.name != "self"]
    if all(p.kind in (P.VAR_POSITIONAL, P.VAR_KEYWORD) for p in t_params):
        return None  # torch's accepts anything: an abstract or forwarding signature
    o_by_name = {p.name: p for p in o_params}
    o_positional = [p for p in o_params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    o_var_pos = any(p.kind == P.VAR_POSITIONAL for p in o_params)
    o_var_kw = any(p.kind == P.VAR_KEYWORD for p in o_params)
    t_names = set()
    for i, p in enumerate(x for x in t_params
                          if x.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)):
        mine = o_positional[i] if i < len(o_positional) else None
        if mine is None and not o_var_pos:
            return f"positional parameter {i} ({p.name!r}) is not accepted"
        if mine is not None and p.kind == P.POSITIONAL_OR_KEYWORD and mine.name != p.name \
                and not p.name.startswith("_"):
            return f"positional parameter {i} is {mine.name!r} here, {p.name!r} in torch"
        if mine is not None and p.default is not P.empty and mine.default is P.empty:
            return f"{p.name!r} is optional in torch, required here"
    for p in t_params:
        t_names.add(p.name)
        if p.name.startswith("_"):
            continue  # torch's private parameters
        if p.kind == P.VAR_POSITIONAL and not o_var_pos:
            return f"*{p.name} is not accepted"
        if p.kind == P.VAR_KEYWORD and not o_var_kw:
            return f"**{p.name} is not accepted"
        if p.kind == P.KEYWORD_ONLY:
            mine = o_by_name.get(p.name)
            if mine is None and not o_var_kw:
                return f"keyword {p.name!r} is not accepted"
            if mine is not None and mine.kind not in (P.KEYWORD_ONLY, P.POSITIONAL_OR_KEYWORD):
                return f"{p.name!r} cannot be passed by keyword here"
            if mine is not None and p.default is not P.empty and mine.default is P.empty:
                return f"{p.name!r} is optional in torch, required here"
    for p in o_params:
        if p.name not in t_names and p.default is P.empty and \
                p.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD):
            return f"ours requires {p.name!r}, which torch does not have"
    return None


def _callable_signature(obj):
    return _signature(obj.__init__ if inspect.isclass(obj) else obj)


@pytest.mark.parametrize("torch_module,ours_module,name", PAIRS,
                         ids=[f"{t}.{n}" for t, _, n in PAIRS])
def test_public_name_is_provided_with_a_compatible_signature(torch_module, ours_module, name):
    if (torch_module, name) in NOT_PROVIDED:
        assert NOT_PROVIDED[(torch_module, name)]
        return
    ours = importlib.import_module(ours_module)
    assert hasattr(ours, name), (
        f"{torch_module}.{name} has no counterpart {ours_module}.{name}: provide it, or list it "
        f"in NOT_PROVIDED with the reason")
    theirs, mine = getattr(importlib.import_module(torch_module), name), getattr(ours, name)
    if not callable(theirs) or (torch_module, name) in SIGNATURE_DIFFERENCES:
        return
    t_sig, o_sig = _callable_signature(theirs), _callable_signature(mine)
    if t_sig is None or o_sig is None:
        return
    problem = _incompatibility(t_sig, o_sig)
    assert problem is None, f"{ours_module}.{name}{o_sig} vs torch's {t_sig}: {problem}"


def _class_members():
    out, seen = [], set()
    for torch_module, ours_module, name in PAIRS:
        theirs = getattr(importlib.import_module(torch_module), name)
        if not inspect.isclass(theirs) or (torch_module, name) in NOT_PROVIDED:
            continue
        for member in vars(theirs):
            if member.startswith("_") or (name, member) in seen:
                continue
            seen.add((name, member))
            out.append((torch_module, ours_module, name, member))
    return out


MEMBERS = _class_members()


@pytest.mark.parametrize("torch_module,ours_module,cls,member", MEMBERS,
                         ids=[f"{c}.{m}" for _, _, c, m in MEMBERS])
def test_public_class_member_is_provided(torch_module, ours_module, cls, member):
    if (cls, member) in MEMBERS_NOT_PROVIDED:
        assert MEMBERS_NOT_PROVIDED[(cls, member)]
        return
    theirs = getattr(importlib.import_module(torch_module), cls)
    ours = getattr(importlib.import_module(ours_module), cls)
    if member in INSTANCE_ATTRIBUTES.get(cls, ()):
        return  # checked on an instance by the tests of that class
    assert hasattr(ours, member), (
        f"torch's {cls}.{member} has no counterpart on ours: provide it, or list it in "
        "MEMBERS_NOT_PROVIDED with the reason")
    t_static = inspect.getattr_static(theirs, member)
    if isinstance(t_static, property) or not callable(getattr(theirs, member)) or \
            (torch_module, f"{cls}.{member}") in SIGNATURE_DIFFERENCES:
        return
    t_sig, o_sig = _signature(getattr(theirs, member)), _signature(getattr(ours, member))
    if t_sig is None or o_sig is None:
        return
    problem = _incompatibility(t_sig, o_sig)
    assert problem is None, f"{cls}.{member}{o_sig} vs torch's {t_sig}: {problem}"


def test_the_lists_name_only_what_torch_has():
    """A stale entry (torch dropped the name, or we now provide it) is removed from the lists."""
    for (torch_module, name), why in NOT_PROVIDED.items():
        assert not hasattr(importlib.import_module(MODULES[torch_module]), name), (
            f"{name} is provided now: drop it from NOT_PROVIDED")
        if _newer_than_installed((torch_module, name)):
            continue  # a newer release's name: this torch cannot have it
        assert hasattr(importlib.import_module(torch_module), name), (torch_module, name)
    members = {(c, m) for _, _, c, m in MEMBERS}
    for key in MEMBERS_NOT_PROVIDED:
        assert key in members or _newer_than_installed(key), key


def test_added_in_is_read_against_the_installed_release():
    installed = "{}.{}".format(*_installed_release())
    newer = "{}.{}".format(_installed_release()[0], _installed_release()[1] + 1)
    ADDED_IN[("X", "old")], ADDED_IN[("X", "new")] = installed, newer
    try:
        assert not _newer_than_installed(("X", "old")) and _newer_than_installed(("X", "new"))
        assert not _newer_than_installed(("X", "unlisted"))
    finally:
        del ADDED_IN[("X", "old")], ADDED_IN[("X", "new")]
    assert all(key in NOT_PROVIDED or key in MEMBERS_NOT_PROVIDED for key in ADDED_IN)


def test_the_signature_check_catches_what_breaks_a_call():
    def torch_like(a, b=1, *, c=None): ...
    sig = inspect.signature
    assert _incompatibility(sig(torch_like), sig(lambda a, b=1, *, c=None, extra=2: 0)) is None
    assert _incompatibility(sig(torch_like), sig(lambda a, b=1, **kw: 0)) is None
    assert "keyword 'c'" in _incompatibility(sig(torch_like), sig(lambda a, b=1: 0))
    assert "optional in torch" in _incompatibility(sig(torch_like), sig(lambda a, b, *, c=0: 0))
    assert "'x' here" in _incompatibility(sig(torch_like), sig(lambda x, b=1, *, c=None: 0))
    assert "requires 'd'" in _incompatibility(sig(torch_like), sig(lambda a, b=1, *, c=None, d: 0))
    assert "positional parameter 1" in _incompatibility(sig(torch_like), sig(lambda a, *, c=1: 0))
