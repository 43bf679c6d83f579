"""The ``torch._foreach_*`` functions on lists of DTensors (every optimizer step), handed
straight to the dispatcher.

The ordinary way of such a call crosses C++ three times per list element: the call's own parse
(which finds DTensor's ``__torch_function__``), the parse again with the hook skipped, and the
dispatcher handing the lists to ``__torch_dispatch__``. Over 100 parameters that second and third
crossing cost ~50 us of a ~160 us ``_foreach_add_`` (the local op itself: ~35 us). What they
decide is the same for every call whose arguments have the same *kinds* (a list of DTensors, a
DTensor, a number of a type, a list of numbers, None, and which keywords): the aten overload and
the arguments ``__torch_dispatch__`` receives. So the first call of each kind is run the ordinary
way and recorded; if it reached the dispatcher as one op with the call's arguments as torch
places them (a keyword naming a positional argument moved into place, arguments equal to their
defaults left out: ``_placed``), later calls of that kind are placed the same way and go to
``DTensor.__torch_dispatch__`` with that overload directly --
which decides, moves and computes as for any call (redistributes included), so nothing about the
values is learned or baked in. What the skipped C++ did besides: the version bump of the lists
the op writes into (autograd's check of tensors saved for backward), done here the same way.

Taken only with grad mode off and outside inference mode (an optimizer step's, clip_grad's):
with grad mode on, autograd may have to record the op; in inference mode, torch bumps no versions.
``_fast_path`` makes the other checks every shortcut makes first (no dispatch mode, recorder,
autocast or forward AD).
"""
from __future__ import annotations

import operator

from . import _caches
from .dtensor import DTensor
from ._dispatch import _DECISIONS, _only_dtensors
from ._quick_call import const
from ._torch_names import increment_version

__all__ = ["key", "learn", "run", "NO_SHORTCUT", "LEARNED"]

NO_SHORTCUT = object()  # a learned verdict: calls of this kind run the ordinary way
# (function, kinds) -> (aten overload, positions of tuples handed on as lists, True where the
# arguments are placed anew every call (a keyword for a positional argument) else the
# (position or keyword, default) of each argument that has one (placed anew when one equals
# it), positions of the lists the op writes into, whether the function returns its first
# argument) or NO_SHORTCUT;
# cleared with the dispatcher's decisions
LEARNED: dict = _caches.register_decisions({})

_NUMBERS = frozenset((int, float, bool))
_DTENSOR_LIST = "DTensor list"
_NUMBER_LIST = "number list"
_DTENSOR_TUPLE = "DTensor tuple"  # positional only: the dispatcher receives it as a list


def _kind(a):
    # a list's length is part of its kind: lists of other lengths than learned are checked by
    # torch's own kernel (the ordinary way) as they always were
    t = type(a)
    if t is list:
        if _only_dtensors(a):
            return _DTENSOR_LIST, len(a)
        return (_NUMBER_LIST, len(a)) if a and set(map(type, a)) <= _NUMBERS else None
    if t is tuple:  # an out-of-place foreach's result (AdamW's denominators), passed on
        return (_DTENSOR_TUPLE, len(a)) if _only_dtensors(a) else None
    if t is DTensor or t in _NUMBERS or a is None:
        return t
    return None  # a plain tensor, anything else the parser might convert: never learned


def key(func, args, kwargs):
    """The learning key of a foreach call (its function and its arguments' kinds), or None
    where an argument is of no kind learned here."""
    kinds = [func]
    for a in args:
        k = _kind(a)
        if k is None:
            return None
        kinds.append(k)
    if kwargs:
        for name, v in kwargs.items():
            k = _kind(v)
            if k is None or _is_tuple_kind(k):
                return None
            kinds.append((name, k))
    return tuple(kinds)


def learn(call_key, func, args, kwargs, records, out) -> None:
    """Remember, for ``call_key``, the overload that the call recorded in ``records`` (the
    dispatcher's records of the ordinary run: (op, args, kwargs, decision, result)) reached
    ``__torch_dispatch__`` as -- if it reached it once, as an op of the function's own name,
    with the call's arguments as that op's schema places them -- and how the function's result
    ``out`` came from the op's: torch's bindings return an in-place function's first argument
    itself (the list it wrote into) and a tuple of an out-of-place one's results. Else: the
    kind runs the ordinary way."""
    learned = NO_SHORTCUT
    if len(records) == 1:
        op, r_args, r_kwargs, _, result = records[0]
        tuples = tuple(i for i, k in enumerate(call_key[1:]) if _is_tuple_kind(k))
        placed = _placed(op, _listed(args, tuples), kwargs or {})
        returns_self = bool(args) and out is args[0]
        if op._schema.name == "aten::" + func.__name__ and placed is not None and \
                _same_arguments(r_args, placed[0]) and _same_keywords(r_kwargs, placed[1]) and \
                (returns_self or _tuple_of(result, out)):
            written = tuple(i for i, a in enumerate(op._schema.arguments)
                            if a.alias_info is not None and a.alias_info.is_write)
            # placed per call where this call's arguments were placed otherwise; else where a
            # value that torch would leave out (equal to its default) comes
            replace = len(placed[0]) != len(args) or placed[1].keys() != (kwargs or {}).keys()
            learned = (op, tuples, replace or _defaulted(op, args, kwargs or {}), written,
                       returns_self)
    if len(LEARNED) >= _DECISIONS.max_size:
        LEARNED.clear()  # bounded as the decisions are; relearning is one ordinary call
    LEARNED[call_key] = learned


def run(learned, types_, args, kwargs):
    """The call through ``__torch_dispatch__`` with the learned overload; what the function
    returns."""
    op, tuples, replace, written, returns_self = learned
    listed = _listed(args, tuples)
    if replace is True or replace and any(_same_value(d, args[k] if type(k) is int else
                                                      kwargs[k]) for k, d in replace):
        listed, kwargs = _placed(op, listed, kwargs or {})
    out = DTensor.__torch_dispatch__(op, types_, listed, kwargs or {})
    for pos in written:  # as autograd's in-place kernel counts a write into each wrapper
        increment_version(args[pos])
    return args[0] if returns_self else tuple(out)


def _is_tuple_kind(kind) -> bool:
    return type(kind) is tuple and kind[0] is _DTENSOR_TUPLE


def _listed(args, tuples):
    """``args`` with the tuples at positions ``tuples`` as lists (as torch hands them on)."""
    if not tuples:
        return args
    args = list(args)
    for i in tuples:
        args[i] = list(args[i])
    return args


def _placed(op, args, kwargs):
    """``(args, kwargs)`` as torch hands them to ``__torch_dispatch__`` for ``op``: a keyword
    naming a positional argument moved to its place (a skipped one before it filled with its
    default), trailing positional and keyword-only arguments equal to their defaults left out
    (torch's ``is_default``: same type and value); None where the call does not fit the
    schema."""
    positional = [a for a in op._schema.arguments if not a.kwarg_only]
    if len(args) > len(positional):
        return None
    placed, used = list(args), 0
    for a in positional[len(args):]:
        if a.name in kwargs:
            placed.append(kwargs[a.name])
            used += 1
        else:
            placed.append(_MISSING)
    for k, a in enumerate(positional):
        if placed[k] is _MISSING:
            if not a.has_default_value():
                return None
            placed[k] = a.default_value
    while placed and _is_default(positional[len(placed) - 1], placed[-1]):
        placed.pop()
    kw = {}
    for a in op._schema.arguments:
        if a.kwarg_only and a.name in kwargs:
            used += 1
            if not _is_default(a, kwargs[a.name]):
                kw[a.name] = kwargs[a.name]
    return (placed, kw) if used == len(kwargs) else None


def _defaulted(op, args, kwargs) -> tuple:
    """``(position or keyword, default)`` of the call's arguments that have a default (read from
    the schema once, here): where one comes equal to it, torch leaves it out of what it hands
    on."""
    positional = [a for a in op._schema.arguments if not a.kwarg_only]
    by_name = {a.name: a for a in op._schema.arguments}
    return tuple([(k, a.default_value) for k, a in enumerate(positional[:len(args)])
                  if a.has_default_value()]
                 + [(k, by_name[k].default_value) for k in kwargs
                    if by_name[k].has_default_value()])


def _is_default(arg, value) -> bool:
    return arg.has_default_value() and _same_value(arg.default_value, value)


_MISSING = object()


def _tuple_of(result, out) -> bool:
    """Whether ``out`` is a tuple of the very tensors of the op's ``result`` (a list)."""
    return type(out) is tuple and type(result) in (list, tuple) and len(result) == len(out) \
        and all(map(operator.is_, result, out))


def _same_arguments(recorded, given) -> bool:
    return len(recorded) == len(given) and all(map(_same_value, recorded, given))


def _same_keywords(recorded: dict, given: dict) -> bool:
    return recorded.keys() == given.keys() and all(
        _same_value(recorded[k], given[k]) for k in given)


def _same_value(recorded, given) -> bool:
    """Whether the dispatcher received ``given`` as it was: the same DTensors (in a fresh list),
    numbers of the same type and value."""
    if recorded is given:
        return True
    if type(recorded) is not type(given):
        return False
    if type(given) is list:
        return len(recorded) == len(given) and all(map(_same_value, recorded, given))
    # const: type and value, a zero with its sign (-0.0 == 0.0, but a kernel may read it)
    return type(given) in _NUMBERS and const(recorded) == const(given)

