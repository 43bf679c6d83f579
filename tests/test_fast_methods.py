"""DTensor's Python-level Tensor methods (_fast_methods.py): every method they define gives what
torch's C method gives on the same DTensor (values, placements, aliasing, versions, errors), on
even and uneven pieces, learned and replayed; torch-function modes and DisableTorchFunction still
see / skip the call as without them; uninstalling leaves torch's methods."""
import operator

import torch

from dtensor_lite import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh
from tests._spies import FunctionNames
from tests.harness import distributed


def _arguments(name, x, other):
    """Positional arguments for ``name`` beside ``self``: a tensor like ``x`` (``other``), a
    number, or a shape, as the method takes."""
    n, m = x.shape
    table = {
        "__matmul__": (other.t(),), "matmul": (other.t(),), "mm": (other.t(),),
        "bmm": None, "view": ((m, n),), "reshape": ((m * n,),), "transpose": (0, 1),
        "permute": ((1, 0),), "unsqueeze": (0,), "squeeze": (), "flatten": (), "t": (),
        "expand": ((n, m),), "sum": (1,), "mean": (0,), "amax": (1,), "pow": (2,),
        "clamp": (-0.5, 0.5), "addcmul_": (other, other), "addcdiv_": (other, other + 3.0),
        "lerp_": (other, 0.25),
    }
    if name in table:
        return table[name]
    if name in ("neg", "exp", "sqrt", "rsqrt", "abs", "relu", "sigmoid", "tanh"):
        return ()
    return (other,)  # binary arithmetic, in place or not


_REORDERED = {"__matmul__", "matmul", "mm", "sum", "mean"}


def _positive(name, t):
    return t.abs() + 1.0 if name in ("sqrt", "rsqrt", "pow", "__truediv__", "div", "div_",
                                     "__itruediv__") else t


@distributed(world_size=2)
def test_every_method_matches_torchs_own_method_and_plain_torch():
    from dtensor_lite import _fast_methods, _fast_path
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    with _fast_path.enabled():
        names = [n for n in _fast_methods._NAMES if n in DTensor.__dict__]
        assert "__add__" in names and "sum" in names and "t" in names
        for rows in (6, 5, 1):  # even, uneven and empty pieces of Shard(0)
            for placement in (Shard(0), Replicate()):
                x0, y0 = torch.randn(rows, 4), torch.randn(rows, 4)
                for name in names:
                    args = _arguments(name, x0, y0)
                    if args is None:
                        continue
                    x = _positive(name, x0)
                    plain_args = tuple(_positive(name, a) if a is y0 else a for a in args)
                    try:
                        ref = getattr(x.clone(), name)(*plain_args)
                    except RuntimeError:
                        continue  # e.g. a view that plain torch refuses for this shape
                    for _ in range(3):  # learned, then replayed
                        dx = distribute_tensor(x, mesh, [placement])
                        dargs = tuple(distribute_tensor(a, mesh, [placement])
                                      if isinstance(a, torch.Tensor) else a for a in plain_args)
                        ours = getattr(DTensor, name)(dx, *dargs)
                        # torch's C method on the same DTensor: the ordinary path
                        theirs = getattr(torch.Tensor, name)(
                            distribute_tensor(x, mesh, [placement]), *dargs)
                        assert isinstance(ours, DTensor), name
                        assert ours.placements == theirs.placements, (name, ours.placements)
                        assert ours.shape == ref.shape, (name, ours.shape, ref.shape)
                        # the same local ops as torch's own method on the same DTensor: equal
                        # to the bit; to plain torch too, except where a contraction or a
                        # reduction sums in another order over pieces (float32 tolerances, at
                        # most 6 terms of magnitude ~1)
                        torch.testing.assert_close(ours.full_tensor(), theirs.full_tensor(),
                                                   rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
                        exact = name not in _REORDERED
                        torch.testing.assert_close(ours.full_tensor(), ref,
                                                   **({"rtol": 0, "atol": 0} if exact else {}),
                                                   msg=lambda m: f"{name}: {m}")
                        if name.startswith("__i") or (name.endswith("_") and
                                                      not name.startswith("__")):
                            assert ours is dx, name  # in place: the destination itself
                        if ours._is_view():
                            assert ours._base is dx, name  # views stay views of their input


@distributed(world_size=2)
def test_in_place_methods_bump_versions_and_autograd_sees_the_write():
    from dtensor_lite import _fast_path
    mesh = init_device_mesh("cpu", (2,))
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    with _fast_path.enabled():
        a, b = distribute_tensor(x, mesh, [Shard(0)]), distribute_tensor(y, mesh, [Shard(0)])
        for _ in range(3):
            version = a._version
            a += b
            assert a._version == version + 1
        torch.testing.assert_close(a.full_tensor(), x + 3 * y)
        w = distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)]).requires_grad_()
        out = (w * a).sum()
        a.mul_(2.0)
        try:
            out.backward()
            raise AssertionError("the in-place write went unnoticed by autograd")
        except RuntimeError as e:
            assert "modified by an inplace operation" in str(e)


@distributed(world_size=2)
def test_modes_and_disabled_hooks_see_the_calls_as_without_the_methods():
    from dtensor_lite import _fast_path
    mesh = init_device_mesh("cpu", (2,))
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    with _fast_path.enabled():
        a, b = distribute_tensor(x, mesh, [Shard(0)]), distribute_tensor(y, mesh, [Shard(0)])
        for _ in range(2):
            a + b, a.sum(1)  # learned and replayed before the mode is on
        with FunctionNames() as mode:
            out = a + b
            total = a.sum(1)
        with _fast_path.enabled(False), FunctionNames() as without:
            a + b, a.sum(1)
        assert mode.names == without.names and "sum" in mode.names, (mode.names, without.names)
        torch.testing.assert_close(out.full_tensor(), x + y)
        torch.testing.assert_close(total.full_tensor(), x.sum(1))
        with torch._C.DisableTorchFunctionSubclass():
            out = a * b
        assert isinstance(out, DTensor)
        torch.testing.assert_close(out.full_tensor(), x * y)


@distributed(world_size=2)
def test_operator_errors_are_torchs():
    from dtensor_lite import _fast_path
    mesh = init_device_mesh("cpu", (2,))
    a = distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)])
    with _fast_path.enabled():
        for op in (operator.add, operator.mul, operator.matmul):
            try:
                op(a, "text")
                raise AssertionError("an operator with a str did not raise")
            except TypeError:
                pass  # Python's own "unsupported operand" (the C method's NotImplemented)
        try:
            a + torch.randn(4, 3)
            raise AssertionError("a DTensor + plain tensor did not raise")
        except ValueError as e:
            assert "plain torch.Tensor" in str(e)
        assert (a + 1).full_tensor().shape == (4, 3)


@distributed(world_size=1)
def test_uninstalling_leaves_torchs_methods():
    from dtensor_lite import _fast_path
    with _fast_path.enabled(False):
        assert "__add__" not in DTensor.__dict__ and "sum" not in DTensor.__dict__
        assert DTensor.__add__ is torch.Tensor.__add__
        mesh = init_device_mesh("cpu", (1,))
        a = distribute_tensor(torch.ones(2, 2), mesh, [Shard(0)])
        assert (a + a).full_tensor().sum().item() == 8.0
    with _fast_path.enabled(True):
        assert "__add__" in DTensor.__dict__
