"""Run a callback once a module is imported, by whoever imports it, without importing it ourselves.

Compile support needs ``torch._dynamo`` (seconds of start-up) only once ``torch.compile`` is used,
and ``torch.compile`` imports it first. So instead of importing Dynamo when dtensor_lite is
imported, compile support asks to be called when Dynamo arrives: at once if it is already in
``sys.modules``, otherwise right after its module has executed (a finder at the front of
``sys.meta_path`` wraps that one module's loader, then steps aside).

Example::

    >>> after_import("torch._dynamo", lambda dynamo: print("Dynamo is here"))
"""
from __future__ import annotations

import importlib.abc
import sys
import threading
from typing import Callable

__all__ = ["after_import"]

_lock = threading.Lock()
_waiting: dict[str, list[Callable]] = {}  # module name -> callbacks not yet run


def after_import(name: str, callback: Callable) -> None:
    """Call ``callback(module)`` once module ``name`` is imported (now, if it already is)."""
    with _lock:
        module = sys.modules.get(name)
        if module is None:
            if name not in _waiting:
                _waiting[name] = []
                sys.meta_path.insert(0, _Finder(name))
            _waiting[name].append(callback)
            return
    callback(module)


def _run_callbacks(name: str, module) -> None:
    with _lock:
        callbacks = _waiting.pop(name, [])
    for callback in callbacks:
        callback(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: hands ``name``'s spec back from the finders after it, with a loader
    that runs the callbacks once the module has executed. It stays until then: a mere
    ``importlib.util.find_spec`` (asking, not importing) must not use it up."""

    def __init__(self, name: str):
        self.name = name

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find and finder is not self else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _ThenRun(spec.loader, self)
                return spec
        return None


class _ThenRun(importlib.abc.Loader):
    """``loader`` unchanged, then the callbacks; the module keeps the original loader."""

    def __init__(self, loader, finder: _Finder):
        self.loader, self.finder = loader, finder

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = module.__spec__.loader = self.loader
        self.loader.exec_module(module)  # if it raises, the finder waits for a later import
        with _lock:
            if self.finder in sys.meta_path:  # one module, once: later imports are untouched
                sys.meta_path.remove(self.finder)
        _run_callbacks(self.finder.name, module)

    def __getattr__(self, attr):  # get_source, is_package, ... as the original loader answers
        return getattr(self.loader, attr)
