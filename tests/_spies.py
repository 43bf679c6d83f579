"""Spies the tests share: which torch functions a TorchFunctionMode is shown, which aten ops a
TorchDispatchMode is shown, which calls reach the process group's own methods, and which calls
a module-level function gets."""
import contextlib

import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode


class FunctionNames(TorchFunctionMode):
    """A mode that records the name of every torch function called under it (``names``) and
    runs it unchanged."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


class OpNames(TorchDispatchMode):
    """A mode that records the name of every aten op dispatched under it (``names``, e.g.
    ``"aten.add.Tensor"``) and runs it unchanged."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def process_group_calls(*methods):
    """Every call of the ``ProcessGroup`` methods named (``"allreduce"``, ...) inside the block,
    as ``(method, args)`` in order: where every collective reaches the backend, whatever Python
    issued it. The methods are restored after (as the descriptors they were: they bind the
    group)."""
    group_class = dist.ProcessGroup
    saved = {m: group_class.__dict__[m] for m in methods}
    calls = []

    def spy(name):
        real = getattr(group_class, name)

        def method(group, *args, **kwargs):
            calls.append((name, args))
            return real(group, *args, **kwargs)
        return method
    for m in methods:
        setattr(group_class, m, spy(m))
    try:
        yield calls
    finally:
        for m, descriptor in saved.items():
            setattr(group_class, m, descriptor)


@contextlib.contextmanager
def calls_of(module, name: str):
    """The argument tuples of every call of ``module.name`` inside the block (a list, filled as
    calls come); the function runs as before and is put back after."""
    real, calls = getattr(module, name), []

    def spy(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)
    setattr(module, name, spy)
    try:
        yield calls
    finally:
        setattr(module, name, real)
