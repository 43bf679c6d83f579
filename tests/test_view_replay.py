"""Views replayed without ``__torch_dispatch__`` (_view_replay.py): a replayed view is what the
ordinary path makes -- global and local metadata, placements, values, ``_base``, the version
counter it shares with its input, autograd's checks on writes through it -- for every view a
method or function reaches, on even, uneven and empty pieces; and where the replay cannot be
proven (a view that copied, a view of such a copy) the ordinary path runs."""
import pytest
import torch

from dtensor_lite import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh
from tests.harness import distributed
# a local piece that is a wrapper subclass: no storage to compare, so no view replay
from tests.test_fast_path import _Wrapper

# every view a user reaches on a 2-D tensor (rows x 6): (name, call)
_VIEWS = [
    ("t", lambda x: x.t()),
    ("T", lambda x: x.T),
    ("mT", lambda x: x.mT),
    ("transpose", lambda x: x.transpose(0, 1)),
    ("permute", lambda x: x.permute(1, 0)),
    ("view", lambda x: x.view(x.shape[0], 2, 3)),
    ("view -1", lambda x: x.view(-1)),
    ("reshape", lambda x: x.reshape(x.shape[0], 3, 2)),
    ("flatten", lambda x: x.flatten()),
    ("unflatten", lambda x: x.unflatten(1, (3, 2))),
    ("unsqueeze", lambda x: x.unsqueeze(0)),
    ("unsqueeze -1", lambda x: x.unsqueeze(-1)),
    ("squeeze", lambda x: x.unsqueeze(1).squeeze(1)),
    ("expand", lambda x: x.unsqueeze(0).expand(2, *x.shape)),
    ("narrow cols", lambda x: x.narrow(1, 1, 3)),
    ("slice cols", lambda x: x[:, 2:]),
    ("select col", lambda x: x[:, 1]),
    ("diagonal", lambda x: x.diagonal()),
    ("movedim", lambda x: torch.movedim(x, 0, 1)),
    ("view_as", lambda x: x.view_as(x)),
    ("alias", lambda x: torch.ops.aten.alias(x)),
    ("unfold", lambda x: x.unfold(1, 2, 2)),
    ("view dtype", lambda x: x.view(torch.int32)),
    ("real", lambda x: x.real),
]


def _layout(t):
    return tuple(t.shape), t.stride(), t.storage_offset(), t.dtype


def _ptr(t):
    return t.untyped_storage().data_ptr()


def _make(mesh, placement, rows):
    torch.manual_seed(rows)
    return distribute_tensor(torch.randn(rows, 6), mesh, [placement])


@distributed(world_size=3)
def test_replayed_views_equal_the_ordinary_path_and_plain_torch():
    from dtensor_lite import _fast_path
    mesh = init_device_mesh("cpu", (3,))
    replayed = set()
    for rows in (6, 5, 2):  # even, uneven, and pieces of which one is empty
        for placement in (Shard(0), Shard(1), Replicate()):
            for name, view in _VIEWS:
                plain = _make(mesh, placement, rows).full_tensor()
                try:
                    ref = view(plain)
                except RuntimeError:
                    continue
                with _fast_path.enabled(False):
                    base = _make(mesh, placement, rows)
                    try:
                        ordinary = view(base)
                    except (RuntimeError, NotImplementedError):
                        continue  # no rule for this view at this layout: the same error below
                # whether the ordinary path's piece is a view of the input's (not a copy made by
                # a redistribute): the replay's must be the same
                aliases = _ptr(ordinary._local_tensor) == _ptr(base._local_tensor)
                for attempt in range(3):  # learned, then replayed
                    with _fast_path.enabled():
                        x = _make(mesh, placement, rows)
                        before = len(_fast_path._SHORTCUTS)
                        ours = view(x)
                    where = (name, rows, placement, attempt)
                    assert type(ours) is DTensor, where
                    assert ours.placements == ordinary.placements, where
                    assert _layout(ours) == _layout(ordinary), where
                    assert _layout(ours._local_tensor) == _layout(ordinary._local_tensor), where
                    assert ours._is_view() == ordinary._is_view(), where
                    assert (ours._base is x) == (ordinary._base is base), where
                    assert not ours.requires_grad, where
                    torch.testing.assert_close(ours.full_tensor(), ref, rtol=0, atol=0)
                    assert (_ptr(ours._local_tensor) == _ptr(x._local_tensor)) == aliases, where
                    if attempt == 2 and len(_fast_path._SHORTCUTS) == before:
                        replayed.add(name)
    # the usual views are replayed (not sent the ordinary way every time)
    assert {"t", "transpose", "view", "unsqueeze", "permute", "expand"} <= replayed, replayed


@distributed(world_size=2)
def test_a_replayed_view_shares_its_inputs_version_counter_and_memory():
    from dtensor_lite import _fast_path
    mesh = init_device_mesh("cpu", (2,))
    with _fast_path.enabled():
        for _ in range(3):
            x = distribute_tensor(torch.arange(12.).view(4, 3), mesh, [Shard(0)])
            v = x.t()
        assert _shortcut_of(torch._C.TensorBase.t, x) is not None  # replayed, not ordinary
        before = x._version
        v.mul_(10)  # a write through the view is a write into its input
        assert x._version == v._version == before + 1
        torch.testing.assert_close(x.full_tensor(), torch.arange(12.).view(4, 3) * 10)
        w = v.unsqueeze(0)  # a view of a view: the same base
        assert w._base is x
        x.add_(1)
        assert w._version == x._version
        torch.testing.assert_close(w.full_tensor(), (torch.arange(12.).view(4, 3) * 10 + 1)
                                   .t().unsqueeze(0))


@distributed(world_size=2)
def test_autograd_checks_writes_through_a_replayed_view_as_through_torchs():
    from dtensor_lite import _fast_path
    mesh = init_device_mesh("cpu", (2,))

    def errors(use_fast_path):
        """What autograd says when a view made before its base needed grad is written into,
        and what a view saved for backward says when its base is written afterwards."""
        out = []
        with _fast_path.enabled(use_fast_path):
            for _ in range(3):
                x = distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)])
                v = x.t()
            x.requires_grad_()
            with pytest.raises(RuntimeError) as e:
                v.mul_(2)
            out.append(str(e.value).split("\n")[0])
            w = distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)])
            for _ in range(3):
                u = w.view(16)
            y = (u * distribute_tensor(torch.randn(16), mesh, [Shard(0)]).requires_grad_())
            w.add_(1)  # u was saved by the mul; its base changed since
            with pytest.raises(RuntimeError) as e:
                y.sum().backward()
            out.append("modified by an inplace operation" in str(e.value))
        return out

    assert errors(True) == errors(False)
    assert errors(True)[1] is True


@distributed(world_size=2)
def test_views_under_grad_and_of_copied_views_take_the_ordinary_path():
    from dtensor_lite import _fast_path
    mesh = init_device_mesh("cpu", (2,))
    with _fast_path.enabled():
        x = distribute_tensor(torch.randn(4, 6), mesh, [Shard(0)]).requires_grad_()
        for _ in range(3):
            v = x.t()
            assert v.grad_fn is not None and v._base is x
        v.sum().backward()
        torch.testing.assert_close(x.grad.full_tensor(), torch.ones(4, 6))
        # a view whose input must move data is a copy; a view of that copy aliases the copy,
        # and a write into either raises (the write would not reach x): replays must not hide it
        y = distribute_tensor(torch.randn(5, 6), mesh, [Shard(1)])
        copied = y.view(30)
        for _ in range(3):
            second = copied.view(5, 6)
        with pytest.raises(RuntimeError, match="holds a copy"):
            second.add_(1)


def _shortcut_of(func, x):
    """The replay learned for ``func(x)`` (no other arguments), or None."""
    from dtensor_lite import _fast_path
    run = _fast_path._SHORTCUTS.get((func, torch.is_grad_enabled(), x._spec))
    return None if run is None or run is _fast_path._NO_SHORTCUT else run


@distributed(world_size=2)
def test_a_view_of_a_subclass_piece_runs_as_without_the_shortcut():
    from dtensor_lite import _fast_path
    mesh = init_device_mesh("cpu", (2,))
    with _fast_path.enabled():
        local = torch.arange(8.0).view(2, 4) + 8 * torch.distributed.get_rank()
        x = DTensor.from_local(_Wrapper(local), mesh, [Shard(0)])
        for _ in range(3):
            v = x.t()
            assert type(v._local_tensor) is _Wrapper and v._base is x
            torch.testing.assert_close(v._local_tensor.inner, local.t())
