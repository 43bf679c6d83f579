"""DTensor's ``__torch_function__``: a shortcut for calls whose outcome is already decided.

Entering ``__torch_dispatch__`` from C++ costs more than the op itself at small sizes (2.3 us vs
1.3 us for an 8x8 add), and it is paid once per aten op: ``F.linear`` is two (``t``, ``mm``).
``__torch_function__`` is entered once per *torch function*, above autograd, for about 0.9 us.
So for a call that needs nothing from autograd, this module replays the aten ops the call
dispatched last time, on the local pieces, and wraps only the final result.

What a call dispatches is learned the first time it is seen: the call runs the ordinary way
(through autograd and ``__torch_dispatch__``) while the dispatcher records each aten op, its
decision and its result. The call becomes a shortcut only if every recorded op was a cache hit of
the plain kind (``_Decision.fast``: nothing to redistribute, no custom aliasing, one tensor out)
and writes only into a tensor an earlier op of the call made (or is the call's one op), the last
op's result is what the function returned and is not a view, and every DTensor the ops read is an
argument of the call or an earlier op's result. (A call that is one view op replays differently:
C++ makes the view on the wrapper, so autograd tracks it as without the shortcut; see
``_view_replay``.) A random op replays its decision's local function,
so it draws exactly as dispatched, with the generator check before each draw (``random.py``).
Then the replay runs exactly the local ops the dispatcher would run, with the same non-tensor
arguments: the key holds every non-tensor argument by type and value (floats ``0.0``/``-0.0``
apart), the input specs, and grad mode, which is all a builtin's decomposition reads of a
DTensor (global metadata). Anything else, or a call that is not a builtin, runs the ordinary way.

When the shortcut is not taken (every check is made per call, each a C-level read):

* grad mode is on and an argument requires grad (autograd must record the op), or forward-mode AD
  or a functorch transform is active;
* a ``TorchDispatchMode`` is active (fake tensors and tracing under ``torch.compile``, memory
  trackers, torch's ``CommDebugMode``: they must see every aten op), or autocast is on (it
  inserts casts). (dtensor_lite's ``CommDebugMode`` counts collectives: a replay has none.)

A ``torch._foreach_*`` call (lists of DTensors: an optimizer step) is not replayed but sent
straight to ``__torch_dispatch__`` once its argument kinds were seen (``_foreach_replay``).

Installed at import; ``DTENSOR_LITE_FAST_PATH=0`` in the environment (or ``uninstall()``) leaves
every call to ``__torch_dispatch__``. The ordinary way skips only DTensor's own hook for the call
(``_skip_one_hop_torch_function``), so a local piece that is a tensor subclass keeps its own
``__torch_function__`` (and its type) as without the hook. Metadata reads that dispatch nothing
(``.shape``, ``.grad``, ``size()``, ...) are DTensor properties installed with the hook, which
read the wrapper without entering it (``_GETTERS``).

A kernel error in a replay re-runs the call the ordinary way, which reports it to the other ranks
(``_failures``) as any dispatched op does. The cache is cleared with the decisions it replays.
Dynamo treats DTensor as a traceable wrapper subclass and never calls this hook while tracing.
"""
from __future__ import annotations

import contextlib
import os
import re
import threading
import types

import torch
import torch.nn.functional as F

from . import _caches, _dispatch, _fast_methods, _foreach_replay, _unchecked
from . import _torch_names as N
from ._aliasing import COPIED_VIEWS
from ._quick_call import cheaper_spelling as _cheaper_spelling, const as _const, \
    quick_callable as _quick_callable
from ._dispatch import _Decision
from ._view_replay import view_runner
from .dtensor import DTensor, use_torch_function
from .ops import _registry

__all__ = ["torch_function"]

# The ordinary path skips DTensor's hook for this one call only. Not
# ``_disabled_torch_function_impl``: that runs the whole call with every subclass's
# ``__torch_function__`` off, so a local piece that is itself a subclass (an FSDP all-gather
# extension's weight, a user's tensor type) would come out of ``detach``/``nn.Parameter``/any op
# as a plain tensor -- unlike a DTensor without this hook, whose local ops see the subclass.
_skip_hop = N.skip_one_hop_torch_function
_disabled = N.disabled_torch_function_impl
_OpOverload = N.OpOverload
_grad_enabled = torch.is_grad_enabled
_any_requires_grad = N.any_requires_grad
_dispatch_modes = N.len_torch_dispatch_stack
_autocast = N.is_any_autocast_enabled
_inference_mode = torch.is_inference_mode_enabled
_make_wrapper = N.make_wrapper_subclass
_fwad = torch.autograd.forward_ad
_BY_FUNCTION = _registry.BY_FUNCTION
_INPLACE_VIEW = torch.Tag.inplace_view
_increment_version = N.increment_version
_RECORDERS = _dispatch.RECORDERS  # the list itself: learns append to and remove from it in place


class _Ordinary(Exception):
    """Raised inside a replay: run this call the ordinary way."""

# builtins: their decomposition into aten ops is C++ that reads only the arguments (and grad
# mode); Python functions may read anything (flags, globals), except these known pure ones
_BUILTIN_TYPES = (types.BuiltinFunctionType, types.MethodDescriptorType,
                  types.WrapperDescriptorType, types.MethodWrapperType)
_PURE_PYTHON = {F.relu, F.silu, F.dropout}  # dropout: reads only its arguments
# functions that return their input untouched for some arguments only (dropout in eval or with
# p=0) and draw for others: an empty recording rules out that key, not the function
_IDENTITY_FOR_SOME = {F.dropout, torch.dropout}
_NO_SHORTCUT = object()  # cached verdict: this key runs the ordinary way
# functions that run the ordinary way whatever their arguments (checked before building a key)
_ORDINARY: set = _caches.register_decisions(set())

# key -> _Replay or _NO_SHORTCUT; cleared with the decisions the replays hold, and when full
_SHORTCUTS: dict = _caches.register_decisions({})
def _ordinary(func, types_, args, kwargs):
    """The call the ordinary way: through autograd to ``__torch_dispatch__``; for a function
    whose op is intercepted (``F.linear`` and the like, ops/_registry.py), what the op's
    autograd kernel would run."""
    intercept = _BY_FUNCTION.get(func)
    if intercept is not None:
        return intercept(*args, **(kwargs or {}))
    if type(func) in _BUILTIN_TYPES:
        if func in _LIST_OVERLOADED:
            # re-parsed by _skip_hop, a list of DTensors matches the ScalarList overload first
            # ("a Tensor with 15 elements cannot be converted to Scalar"): run with hooks off
            return _disabled(func, types_, args, kwargs or {})
        try:
            return _skip_hop(func, types_, args, kwargs)
        except TypeError as e:
            # the same parser mismatch where an overload takes ints and fails loudly
            # (``histogramdd(x, bins=[DTensor, ...])``: the ``int[]`` overload is tried first);
            # parsing fails before anything runs, so the call is made again with the hooks off
            if not _PARSE_FAILURES.search(str(e)):
                raise
            return _disabled(func, types_, args, kwargs or {})
    if type(func) is _OpOverload or (_ident(), func) in _IN_FLIGHT:
        # an aten op called on DTensors from Python (a rule's or a composite kernel's
        # ``op.decompose(...)`` arrives here as the overload itself), or a Python function
        # (``Tensor.unflatten``) whose C method reports the call again under the same name:
        # calling either once more would come back here, so it runs with the hooks off inside
        return _disabled(func, types_, args, kwargs or {})
    flight = (_ident(), func)
    _IN_FLIGHT.add(flight)
    try:
        return _skip_hop(func, types_, args, kwargs)
    finally:
        _IN_FLIGHT.discard(flight)


# builtins with both a TensorList and a ScalarList overload (torch._foreach_maximum, ...)
_LIST_OVERLOADED = {getattr(torch, n) for n in dir(N.VariableFunctions)
                    if n.startswith("_foreach_")}

# (thread, Python function) pairs running the ordinary way now
_IN_FLIGHT: set = set()
_ident = threading.get_ident
_PARSE_FAILURES = re.compile(r"failed to unpack the object|invalid combination of arguments")


def _kwargs_key(kwargs, dts: list):
    if len(kwargs) == 1:  # the usual one keyword (``alpha=``, ``dim=``): no loop
        (k, v), = kwargs.items()
        if type(v) is DTensor:
            dts.append(v)
            return ((k, v._spec),)
        c = _const(v)
        return None if c is None else ((k, c),)
    key = []
    for k, v in kwargs.items():
        if type(v) is DTensor:
            dts.append(v)
            key.append((k, v._spec))
        else:
            c = _const(v)
            if c is None:
                return None
            key.append((k, c))
    return tuple(key)


def torch_function(cls, func, types_, args=(), kwargs=None):
    # first the calls that must run the ordinary way whatever their key: functions that never
    # shortcut (no aten op, Python code), calls autograd must record, and calls under
    # something that must see every op. functorch transforms need no check: inside them the
    # arguments are batched or grad-tracking tensors, not DTensors. A call inside a call being
    # learned (a composite's Python kernel) runs the ordinary way: a replay there would hide its
    # ops from the outer call's recording. (All before the key: each is a C-level read, and a
    # call they send the ordinary way would have gone there whatever its key.)
    if func in _ORDINARY:
        return _ordinary(func, types_, args, kwargs)
    grad = _grad_enabled()
    if grad and _any_requires_grad(*args):  # keywords: once the key has found their DTensors
        return _ordinary(func, types_, args, kwargs)
    if _RECORDERS or _dispatch_modes() or _autocast() or _fwad._current_level >= 0:
        return _ordinary(func, types_, args, kwargs)
    if func in _LIST_OVERLOADED:  # torch._foreach_*: lists of DTensors, another key
        return _foreach(func, types_, args, kwargs, grad)
    # The key: the function, grad mode, each DTensor's spec, every other argument as a constant
    # (specs are interned: hashing the key never calls back into Python). Built inline: this is
    # the hot path of every call on a DTensor; the usual shapes first (one or two positional
    # arguments, the first a DTensor: unary and binary ops, ``sum(dim)``, ``F.linear``), the same
    # key as the loop's.
    n = len(args)
    if not kwargs and n == 1 and type(args[0]) is DTensor:  # unary: relu(x), x.t(), x.sum()
        key = (func, grad, args[0]._spec)
        dts = args
    elif not kwargs and n == 2 and type(args[0]) is DTensor:
        a1 = args[1]
        if type(a1) is DTensor:
            key = (func, grad, args[0]._spec, a1._spec)
            dts = args
        else:
            c = (int, a1) if type(a1) is int else _const(a1)  # an int: what _const gives it
            if c is None:
                return _ordinary(func, types_, args, kwargs)
            key = (func, grad, args[0]._spec, c)
            dts = (args[0],)
    elif n == 2 and type(args[0]) is DTensor and type(args[1]) is DTensor and len(kwargs) == 1:
        # binary with one keyword (``a.add_(b, alpha=2.0)``): the keyword's name and constant
        # inline (a key that hashes no nested tuple of tuples); no other branch keys this shape
        (k, v), = kwargs.items()
        c = _const(v)
        key, dts = ((func, grad, args[0]._spec, args[1]._spec, k, c), args) if c is not None \
            else _loop_key(func, grad, args, kwargs)
    else:
        key, dts = _loop_key(func, grad, args, kwargs)
    if key is None:
        return _ordinary(func, types_, args, kwargs)
    run = _SHORTCUTS.get(key)
    if run is None:
        return _learn(key, func, types_, args, kwargs, dts)
    if run is not _NO_SHORTCUT:
        try:
            out = run(dts)
        except Exception:  # noqa: BLE001 - the ordinary path reports and raises it
            pass
        else:
            return _unchecked.propagate(args, kwargs, out) if _unchecked.MARKED else out
    return _ordinary(func, types_, args, kwargs)


def _loop_key(func, grad, args, kwargs):
    """``(key, DTensors)`` for the argument shapes ``torch_function`` does not spell out, or
    ``(None, None)`` for a call that must run the ordinary way: an argument the key cannot hold,
    no DTensor at all, or a keyword DTensor that autograd must record."""
    dts = []
    key = [func, grad]
    for a in args:
        if type(a) is DTensor:
            dts.append(a)
            key.append(a._spec)
        else:
            c = _const(a)
            if c is None:
                return None, None
            key.append(c)
    if kwargs:
        c = _kwargs_key(kwargs, dts)
        if c is None or (grad and _any_requires_grad(*dts)):
            return None, None
        key.append(c)
    if not dts:
        return None, None
    return tuple(key), dts


def _foreach(func, types_, args, kwargs, grad):
    """A ``torch._foreach_*`` call: straight to the dispatcher where its kind was learned
    (``_foreach_replay``), with grad mode off and outside inference mode."""
    key = None if grad or _inference_mode() else _foreach_replay.key(func, args, kwargs)
    if key is None:
        return _ordinary(func, types_, args, kwargs)
    learned = _foreach_replay.LEARNED.get(key)
    if learned is None:
        out, recorder = _recorded_ordinary(func, types_, args, kwargs)
        _foreach_replay.learn(key, func, args, kwargs, recorder, out)
        return out
    if learned is _foreach_replay.NO_SHORTCUT:
        return _ordinary(func, types_, args, kwargs)
    return _foreach_replay.run(learned, types_, args, kwargs)


def _recorded_ordinary(func, types_, args, kwargs):
    """``(result, records)``: the call the ordinary way, with the dispatcher's record of each op
    it dispatched ((op, args, kwargs, decision, result))."""
    recorder: list = []
    _dispatch.RECORDERS.append(recorder)
    try:
        out = _ordinary(func, types_, args, kwargs)
    finally:
        # by identity: a nested call's recorder (an empty list) would compare equal to another
        del _dispatch.RECORDERS[next(i for i, r in enumerate(_dispatch.RECORDERS) if r is recorder)]
    return out, recorder


def _learn(key, func, types_, args, kwargs, dts):
    out, recorder = _recorded_ordinary(func, types_, args, kwargs)
    if len(_SHORTCUTS) >= _dispatch._DECISIONS.max_size:
        _SHORTCUTS.clear()  # bounded like the decisions replays hold; relearning is one call
    if not recorder and func in _IDENTITY_FOR_SOME and any(out is dt for dt in dts):
        _SHORTCUTS[key] = _NO_SHORTCUT  # these arguments only: dropout in eval returns its input
    elif not (type(func) in _BUILTIN_TYPES or func in _PURE_PYTHON) or not recorder:
        _ORDINARY.add(func)  # whatever the arguments: no aten op, or Python code
    elif isinstance(out, DTensor) and out is recorder[-1][4] and recorder[-1][0].is_view:
        # a view: made by C++ on the wrapper (autograd's view tracking), or the ordinary way
        run = view_runner(recorder[0], dts, out) if len(recorder) == 1 else None
        _SHORTCUTS[key] = _NO_SHORTCUT if run is None else run
    else:
        replay = _Replay.of(recorder, dts, out)
        _SHORTCUTS[key] = _NO_SHORTCUT if replay is None else replay.runner()
    return out


class _Replay:
    """The local ops one call dispatched, with where each reads its DTensors from."""

    __slots__ = ("steps", "single", "shape", "stride", "dtype", "spec", "written")

    @staticmethod
    def of(records, dts, out) -> "_Replay | None":
        if not records or not isinstance(out, DTensor) or out is not records[-1][4]:
            return None
        if len({id(dt) for dt in dts}) != len(dts):
            # ``a + a`` keys like ``a + b``: the replay reads arguments by position, which a call
            # with one tensor twice cannot teach (a call with distinct ones serves both)
            return None
        sources = {id(dt): j for j, dt in enumerate(dts)}  # DTensor -> index in the value list
        fresh = set()  # indices of tensors an earlier op made (not views): only the call holds them
        steps = []
        for i, (op, args, kwargs, d, result) in enumerate(records):
            if (type(d) is not _Decision or not d.fast
                    or type(result) is not DTensor
                    or any(type(v) is DTensor for v in kwargs.values())
                    # a write: never one that re-views; into an argument only as the call's one
                    # op; else into a fresh tensor of the call's own (dropout's noise)
                    or (d.mutated is not None and (_INPLACE_VIEW in op.tags or (
                        len(records) != 1 and _written_source(d, args, sources) not in fresh)))):
                return None
            slots = []
            for pos in d.flat_positions:
                j = sources.get(id(args[pos]))
                if j is None:  # a DTensor the call did not pass in and no earlier op made
                    return None
                slots.append((pos, j))
            positions = set(d.flat_positions)
            if any(_const(a) is None for k, a in enumerate(args) if k not in positions) or \
                    any(_const(v) is None for v in kwargs.values()):
                return None  # a plain tensor or an object the replay could not bake in
            if d.mutated is None:  # a write returns its destination: known already
                # run() appends every step's result: step i's is value len(dts) + i
                sources[id(result)] = len(dts) + i
                if d.view_src is None and not op.is_view:
                    fresh.add(len(dts) + i)
            local_args = list(args)
            for pos in d.flat_positions:
                local_args[pos] = args[pos]._local_tensor
            fn = _quick_callable(op, local_args, kwargs, d.local_fn)
            base = list(args)
            if type(fn) in _BUILTIN_TYPES:  # torch.<name>, Tensor.<name>: perhaps spelled cheaper
                base = _cheaper_spelling(fn, op, local_args, kwargs)
            steps.append((fn, base, tuple(slots), dict(kwargs)))
        last = records[-1][3]
        if last.view_src is not None:  # a view must alias its input (autograd, version counter)
            return None
        r = _Replay()
        r.written = None
        if last.mutated is not None:  # the call writes into, and returns, one of its arguments
            r.written = sources.get(id(records[-1][4]))
            if r.written is None or r.written >= len(dts):
                return None
        r.steps = tuple(steps)
        r.single = None
        # the strides the dispatcher builds this wrapper with (None where contiguous)
        r.shape, r.stride, r.dtype, r.spec = last.out_shape, last.wrap_stride, last.out_dtype, \
            last.out_specs
        # the records hold the call's tensors: keep nothing but positions and constants
        for fn, base, slots, kw in steps:
            for pos, _ in slots:
                base[pos] = None
        if len(steps) == 1:
            r.single = _single_step(*steps[0])
        return r

    def runner(self):
        """``run``, or for the usual shapes (one op) a closure doing the same with everything
        it reads bound in advance (no attribute lookups per call)."""
        if self.single is None:
            return self.run
        if self.written is not None:  # one in-place op: ``a.add_(b)``, ``a.mul_(2)``
            single, written = self.single, self.written
            fn, base, slots, kw = self.steps[0]
            if slots == ((0, 0), (1, 1)) and len(base) == 2:  # a.add_(b[, alpha=...]) inline
                def run_write_two(dts):
                    if COPIED_VIEWS:
                        raise _Ordinary  # as run_write
                    dst = dts[written]
                    fn(dts[0]._local_tensor, dts[1]._local_tensor, **kw)
                    _increment_version((dst,))
                    return dst
                return run_write_two

            def run_write(dts):
                if COPIED_VIEWS:
                    raise _Ordinary  # the ordinary path refuses writes into views that copied
                single(dts)
                dst = dts[written]
                _increment_version((dst,))  # as autograd counts a write into the wrapper
                return dst
            return run_write
        shape, stride, dtype, spec = self.shape, self.stride, self.dtype, self.spec
        fn, base, slots, kw = self.steps[0]
        # the usual argument shapes spelled out: one Python frame per call, not two
        if not kw and slots == ((0, 0), (1, 1)) and len(base) == 2:
            def run_two(dts):
                out = fn(dts[0]._local_tensor, dts[1]._local_tensor)
                r = _make_wrapper(DTensor, shape, stride, None, None, dtype, out.layout,
                                  out.device)
                r._local_tensor = out
                r._spec = spec
                return r
            return run_two
        if not kw and slots == ((0, 0),) and len(base) <= 2:
            rest = tuple(base[1:])

            def run_one(dts):
                out = fn(dts[0]._local_tensor, *rest)
                r = _make_wrapper(DTensor, shape, stride, None, None, dtype, out.layout,
                                  out.device)
                r._local_tensor = out
                r._spec = spec
                return r
            return run_one
        single = self.single

        def run_single(dts):
            out = single(dts)
            r = _make_wrapper(DTensor, shape, stride, None, None, dtype, out.layout, out.device)
            r._local_tensor = out
            r._spec = spec
            return r
        return run_single

    def run(self, dts):
        if COPIED_VIEWS and self.written is not None:
            raise _Ordinary  # the ordinary path refuses writes into views that copied
        if self.single is not None:
            out = self.single(dts)
        else:
            values = [dt._local_tensor for dt in dts]
            for fn, base, slots, kw in self.steps:
                largs = base.copy()
                for pos, j in slots:
                    largs[pos] = values[j]
                values.append(fn(*largs, **kw))
            out = values[-1]
        if self.written is not None:
            dst = dts[self.written]
            _increment_version((dst,))  # as autograd counts a write into the wrapper
            return dst
        r = _make_wrapper(DTensor, self.shape, self.stride, None, None, self.dtype, out.layout,
                          out.device)
        r._local_tensor = out
        r._spec = self.spec
        return r


def _written_source(d, args, sources):
    """The value index of the DTensor a recorded in-place op wrote into."""
    return sources.get(id(args[d.flat_positions[d.mutated]]))


def _single_step(fn, base, slots, kw):
    """The local call of a one-op replay, without the general loop for the usual shapes."""
    if kw and slots == ((0, 0), (1, 1)) and len(base) == 2:  # a.add_(b, alpha=2.0)
        return lambda dts: fn(dts[0]._local_tensor, dts[1]._local_tensor, **kw)
    if kw:
        def call_kw(dts):
            largs = base.copy()
            for pos, j in slots:
                largs[pos] = dts[j]._local_tensor
            return fn(*largs, **kw)
        return call_kw
    if slots == ((0, 0),) and len(base) == 1:
        return lambda dts: fn(dts[0]._local_tensor)
    if slots == ((0, 0),) and len(base) == 2:
        second = base[1]
        return lambda dts: fn(dts[0]._local_tensor, second)
    if slots == ((0, 0), (1, 1)) and len(base) == 2:
        return lambda dts: fn(dts[0]._local_tensor, dts[1]._local_tensor)

    def call(dts):
        largs = base.copy()
        for pos, j in slots:
            largs[pos] = dts[j]._local_tensor
        return fn(*largs)
    return call


# Metadata that a DTensor's wrapper answers without dispatching: with the hook installed, each
# read of ``.shape`` or ``p.grad`` would enter ``__torch_function__`` from C++ (0.9 us, 7x the
# read itself). Properties and methods of these names on DTensor answer from the wrapper with
# the hook off for that one read (0.25 us). Only reads that run no op: ``data``, ``T`` and the
# like dispatch, and keep the ordinary path.
_GETTERS = ("shape", "dtype", "device", "ndim", "layout", "requires_grad", "grad", "grad_fn",
            "is_leaf", "is_sparse", "is_cuda", "is_meta", "is_quantized", "is_nested", "_base",
            "_version", "output_nr")
_METHODS = ("size", "dim", "stride", "numel", "storage_offset", "element_size",
            "get_device", "is_floating_point", "is_complex")
_SET = {"requires_grad", "grad"}
_DESCRIPTORS: dict = {}


def _descriptor(name):
    base = getattr(N.TensorBase, name)
    if name in _METHODS:
        def method(self, *args, **kwargs):
            return _disabled(base, (), (self, *args), kwargs)
        method.__name__ = method.__qualname__ = name
        method.__doc__ = base.__doc__
        return method
    get = base.__get__

    def fget(self):
        return _disabled(get, (), (self,))
    if name not in _SET:
        return property(fget, doc=base.__doc__)
    set_ = base.__set__

    def fset(self, value):
        _disabled(set_, (), (self, value))
    return property(fget, fset, doc=base.__doc__)


def _use_descriptors(on: bool) -> None:
    for name in (*_GETTERS, *_METHODS):
        if on:
            if name not in _DESCRIPTORS:
                _DESCRIPTORS[name] = _descriptor(name)
            setattr(DTensor, name, _DESCRIPTORS[name])
        elif name in DTensor.__dict__:
            delattr(DTensor, name)


def install(on: bool = True) -> None:
    """Install (or, with False, remove) the shortcut as DTensor's ``__torch_function__``.

    Installed at import unless the environment sets ``DTENSOR_LITE_FAST_PATH=0``; without it,
    every call on a DTensor goes straight to ``__torch_dispatch__`` (same results, more
    overhead per call). A torch without ``torch._C._skip_one_hop_torch_function`` (older than
    the supported range) never gets the shortcut.

    Example::

        >>> from dtensor_lite import _fast_path
        >>> _fast_path.uninstall()   # e.g. to rule the shortcut out while debugging
        >>> _fast_path.install()
    """
    # the ordinary way of a call (_skip_hop) needs that torch name: without it, no shortcut
    on = on and _skip_hop is not None
    use_torch_function(torch_function if on else None)
    _registry.hook_intercepts(on)
    _use_descriptors(on)
    _fast_methods.install(on, torch_function, DTensor)


def uninstall() -> None:
    """Remove the shortcut: DTensor's ``__torch_function__`` back to torch's disabled one."""
    install(False)


def installed() -> bool:
    """Whether the shortcut is DTensor's ``__torch_function__`` now."""
    return getattr(DTensor.__torch_function__, "__func__", None) is torch_function


@contextlib.contextmanager
def enabled(on: bool = True):
    """The shortcut installed (or, with False, removed) for the block; the previous state after."""
    before = installed()
    install(on)
    try:
        yield
    finally:
        install(before)


install(os.environ.get("DTENSOR_LITE_FAST_PATH", "1") != "0")
