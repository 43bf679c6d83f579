"""The one place where dtensor_lite looks up names that a torch release may add, rename or remove.

A new torch release must cost a table row, not an import error (torch 2.14 removed the aten ops
``cholesky`` and ``qr``; importing a rule file that named them stopped the whole library). So:

- ``aten``: stands for ``torch.ops.aten`` in every module of ours. An op this torch has resolves
  to torch's own ``OpOverloadPacket`` / ``OpOverload`` (and is cached on the namespace, so the
  second lookup costs what ``torch.ops.aten``'s does). An op it lacks resolves to a ``Missing``
  placeholder: it equals no real op, ``register_rule`` skips it (an op torch removed simply has
  no rule), and calling it raises an error that names the op and the torch version.
- ``private("torch._C._storage_Use_Count")``: a private torch attribute, or None where this
  release has none; the caller says what it does without it.

Every lookup is recorded in ``LOOKED_UP``, so a test can walk what the library asked for on the
installed torch: each name either resolves or is listed in ``KNOWN_ABSENT`` for this release.
"""
from __future__ import annotations

import importlib

import torch

# What a supported release is known to lack: name -> (the first release without it, what to use
# instead). A name missing from the installed torch and not listed here is a surprise that
# tests/test_torch_names.py reports; a listed name that a release from "since" on still has
# (or an older one lacks) is a wrong row, reported too.
KNOWN_ABSENT: dict[str, tuple[str, str]] = {
    "aten.cholesky": ("2.14", "use linalg_cholesky_ex"),
    "aten.qr": ("2.14", "use linalg_qr"),
}

# every name looked up through this module: "aten.<op>[.<overload>]" or a dotted private path,
# mapped to whether the installed torch has it
LOOKED_UP: dict[str, bool] = {}


def _why_absent(name: str) -> str:
    if name in KNOWN_ABSENT:
        since, instead = KNOWN_ABSENT[name]
        return f"torch {since} removed it ({instead})"
    return "this torch may be outside the supported range (pyproject.toml)"


def _absent(name: str, table_key: str | None = None) -> NotImplementedError:
    """The error of using ``name``, which this torch lacks (one message for ops and names)."""
    return NotImplementedError(
        f"{name} does not exist in torch {torch.__version__}, and dtensor_lite needs it here; "
        f"{_why_absent(table_key or name)} (docs/compatibility.md)")


class Missing:
    """An aten op (or overload) this torch does not have. Equal to nothing real; any overload of
    it is Missing too; calling it raises."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __getattr__(self, overload: str) -> "Missing":
        if overload.startswith("__"):
            raise AttributeError(overload)
        return Missing(f"{self.name}.{overload}")

    def overloads(self) -> list:
        return []

    def __call__(self, *args, **kwargs):
        raise _absent(f"aten.{self.name}", "aten." + self.name.split(".")[0])

    def __repr__(self) -> str:
        return f"Missing(aten.{self.name})"


class _TolerantAten:
    """``torch.ops.aten`` that answers a missing op with ``Missing`` instead of raising."""

    def __getattr__(self, name: str):
        try:
            packet = getattr(torch.ops.aten, name)
        except (AttributeError, RuntimeError):
            if name.startswith("__") and name.endswith("__"):  # a Python protocol probe
                raise AttributeError(name) from None
            LOOKED_UP[f"aten.{name}"] = False
            return Missing(name)
        LOOKED_UP[f"aten.{name}"] = True
        setattr(self, name, packet)  # cached: the next lookup is a plain attribute read
        return packet


aten = _TolerantAten()


def is_missing(op) -> bool:
    return isinstance(op, Missing)


def find_op(name: str):
    """The aten packet ``name`` where this torch has it, else None: for code that asks *whether*
    an op exists (a ``_copy`` twin, an optional fused kernel), not recorded as a requirement."""
    return getattr(torch.ops.aten, name, None)


_ABSENT = object()


def private(path: str, default=_ABSENT):
    """The attribute at dotted ``path`` (``"torch._C._foo"``, ``"torch.utils._pytree.tree_map"``).
    Where this torch has no such module or attribute: ``default`` if given (the caller's way of
    doing without it), else a stand-in that raises, when called, an error naming the name and
    the torch version -- so the library still imports and only the feature that needs it fails."""
    parts = path.split(".")
    obj, i = None, len(parts)
    while i > 0:  # the longest importable module prefix
        try:
            obj = importlib.import_module(".".join(parts[:i]))
            break
        except ImportError:
            i -= 1
    for attr in parts[i:] if obj is not None else ():
        obj = getattr(obj, attr, _ABSENT)
        if obj is _ABSENT:
            break
    found = obj is not None and obj is not _ABSENT
    LOOKED_UP[path] = found
    if found:
        return obj
    if default is not _ABSENT:
        return default
    return _Unavailable(path)


class _Unavailable:
    """A required private torch name this release lacks: raises when used."""

    def __init__(self, path: str):
        self.path = path

    def __call__(self, *args, **kwargs):
        raise _absent(self.path)

    def __repr__(self) -> str:
        return f"_Unavailable({self.path})"


class _UnavailableBase:
    """A base class torch no longer provides: subclasses still define (the library imports),
    making one raises."""
    _path = "?"

    def __init__(self, *args, **kwargs):
        raise _absent(self._path)


def private_class(path: str) -> type:
    """A private torch class we subclass or check ``isinstance`` against; where this torch lacks
    it, a stand-in base that raises when instantiated (and that nothing is an instance of)."""
    return private(path, None) or type(f"Unavailable_{path.rsplit('.', 1)[-1]}",
                                       (_UnavailableBase,), {"_path": path})


# ----------------------------------------------------------------------------------------------
# The private torch names the library uses, each looked up once here. Hot paths bind them to
# module globals, so the lookup costs nothing per call.
OpOverload = private_class("torch._ops.OpOverload")
OpOverloadPacket = private_class("torch._ops.OpOverloadPacket")
TensorBase = private_class("torch._C.TensorBase")
TorchDispatchMode = private_class("torch.utils._python_dispatch.TorchDispatchMode")
VariableFunctions = private("torch._C._VariableFunctions")
no_dispatch = private("torch.utils._mode_utils.no_dispatch")
disabled_torch_function_impl = private("torch._C._disabled_torch_function_impl")
# None on a torch without it (2.11 and older): the dispatch shortcut (_fast_path) then stays off
skip_one_hop_torch_function = private("torch._C._skip_one_hop_torch_function", None)
len_torch_dispatch_stack = private("torch._C._len_torch_dispatch_stack")
len_torch_function_stack = private("torch._C._len_torch_function_stack")
is_torch_function_enabled = private("torch._C._is_torch_function_enabled")
any_requires_grad = private("torch._C._any_requires_grad")
is_any_autocast_enabled = private("torch._C._is_any_autocast_enabled")
increment_version = private("torch._C._increment_version")
unsafe_set_version_counter = private("torch._C._autograd._unsafe_set_version_counter")
current_autograd_node = private("torch._C._current_autograd_node")
current_graph_task_id = private("torch._C._current_graph_task_id")
storage_use_count = private("torch._C._storage_Use_Count")
meta_in_tls_dispatch_include = private("torch._C._meta_in_tls_dispatch_include")
set_meta_in_tls_dispatch_include = private("torch._C._set_meta_in_tls_dispatch_include")
is_functional_tensor = private("torch._is_functional_tensor")
is_functorch_wrapped_tensor = private("torch._C._functorch.is_functorch_wrapped_tensor")
dispatch_get_all_op_names = private("torch._C._dispatch_get_all_op_names")
get_operation_overload = private("torch._C._get_operation_overload", None)  # callers fall back
jit_get_all_schemas = private("torch._C._jit_get_all_schemas")
# a decorator keeping Dynamo out of a function; a torch without it traces the function instead
# (torch's own wrapper: it imports Dynamo at its first call, not here)
disable_dynamo = private("torch._disable_dynamo", lambda fn: fn)
# Dynamo costs seconds of start-up: its names are looked up only once something else (torch.compile)
# has imported it (compile_support.py); DEFERRED lists them so tests/test_torch_names.py checks them
DYNAMO = "torch._dynamo"
NONSTRICT_TRACE = "torch._dynamo.nonstrict_trace"
DEFERRED = (NONSTRICT_TRACE,)
make_wrapper_subclass = private("torch.Tensor._make_wrapper_subclass")
autograd_engine = private("torch.autograd.Variable._execution_engine")  # queue_callback
backend_options = private_class("torch._C._distributed_c10d.Backend.Options")
# dispatch modes: the stack, and setting the user's modes aside (_unseen.py)
len_pre_dispatch_stack = private("torch._ops._len_torch_dispatch_stack_pre_dispatch")
disable_current_modes = private("torch.utils._python_dispatch._disable_current_modes")
current_dispatch_mode_stack = private("torch.utils._python_dispatch._get_current_dispatch_mode_stack")
get_dispatch_mode = private("torch._C._get_dispatch_mode")
dispatch_mode_keys = private("torch._C._TorchDispatchModeKey")
# whether a TorchFunctionMode is active: a local kernel called through torch's Python bindings
# would show it our internal calls (shortcuts call the aten op directly then)
torch_function_mode_enabled = private("torch._C._is_torch_function_mode_enabled", lambda: True)
# dist's world state: its collective functions queue a collective instead of issuing it while a
# ``_coalescing_manager`` collects for the group (``pg_coalesce_state``, read per call)
c10d_world = private("torch.distributed.distributed_c10d._world", None)
foreach_norm = private("torch._foreach_norm")
foreach_mul_ = private("torch._foreach_mul_")
# torch.utils._pytree: the pytree torch's own APIs flatten with
tree_map = private("torch.utils._pytree.tree_map")
tree_flatten = private("torch.utils._pytree.tree_flatten")
tree_unflatten = private("torch.utils._pytree.tree_unflatten")
tree_leaves = private("torch.utils._pytree.tree_leaves")
