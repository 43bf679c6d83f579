"""Ops that work slice by slice over some dims: linear algebra on the last two dims, pooling and
upsampling over the trailing spatial dims. (FFTs are in ``fft.py``: they transform a list of
dims, not the trailing ones, and MKL refuses the empty piece a rank can hold.)

Every slice along the other (batch / channel) dims is computed on its own, so a shard of one of
those dims stays where it is and moves nothing; only a dim the op mixes has to be whole. The
inputs of one call share their leading dims (a matrix and its right-hand sides, an output
gradient and the input), so a batch dim is sharded alike in all of them, and every output (which
keeps the batch dims in front) is sharded on it too.
"""
from __future__ import annotations

import torch

from .. import _torch_names as torch_names
from ..placements import Replicate, Shard
from ._registry import register_rule

aten = torch_names.aten
R = Replicate()


def _slicewise(call, mixed: set):
    """All-Replicate, or Shard(d) everywhere for a dim d outside ``mixed`` that every input has
    at the same place with the same size."""
    x = call.inputs[0]
    n_in = len(call.inputs)
    n_out = sum(1 for r in call.op._schema.returns if "Tensor" in str(r.type))
    strategies = [((R,) * n_out, (R,) * n_in)]
    for d in range(x.ndim):
        if d not in mixed and all(s.ndim == x.ndim and s.shape[d] == x.shape[d]
                                  for s in call.inputs):
            strategies.append(((Shard(d),) * n_out, (Shard(d),) * n_in))
    return strategies


def _trailing(k):
    def rule(call):
        ndim = call.inputs[0].ndim
        return _slicewise(call, set(range(ndim - k, ndim)))
    return rule


# linear algebra: a batch of matrices, each factorised / inverted / solved on its own
register_rule(
    aten._linalg_eigh.default, aten.linalg_eig.default, aten._linalg_eigvals.default,
    aten.linalg_eigvals.default, aten._linalg_svd.default, aten.linalg_qr.default,
    aten.linalg_inv_ex.default, aten.linalg_cholesky_ex.default, aten.cholesky.default,
    aten._linalg_det.default, aten._linalg_slogdet.default, aten.linalg_lu_factor_ex.default,
    aten.linalg_lu.default, aten.linalg_matrix_exp.default, aten.cholesky_inverse.default,
    aten.cholesky_solve.default, aten.triangular_solve.default,
    aten.linalg_solve_triangular.default, aten._linalg_solve_ex.default,
)(_trailing(2))

# pooling and upsampling over the last 1-3 dims; batch and channel dims are independent
register_rule(aten.max_pool2d_with_indices.default, aten.avg_pool2d.default,
              aten._adaptive_avg_pool2d.default, aten.adaptive_max_pool2d.default,
              aten.max_pool2d_with_indices_backward.default, aten.avg_pool2d_backward.default,
              aten._adaptive_avg_pool2d_backward.default,
              aten.adaptive_max_pool2d_backward.default,
              aten.upsample_nearest2d.default, aten.upsample_nearest2d.vec,
              aten.upsample_bilinear2d.default, aten.upsample_bilinear2d.vec)(_trailing(2))


def _overloads(*names):
    """Every overload (default, vec, ...) of the named aten ops that this torch has."""
    out = []
    for name in names:
        packet = torch_names.find_op(name)
        out += [getattr(packet, o) for o in packet.overloads()] if packet is not None else []
    return out


# the other resampling ops (antialiased, bicubic, exact-nearest; 1-D and 3-D): the same, with
# their backwards (the gradient's trailing dims are the input's image); PyTorch shards their
# batch dims too, so gathering the input would cost more than it does
register_rule(*_overloads("_upsample_bicubic2d_aa", "_upsample_bilinear2d_aa",
                          "_upsample_bilinear2d_aa_backward", "_upsample_lanczos2d_aa",
                          "_upsample_lanczos2d_aa_backward", "_upsample_nearest_exact2d",
                          "_upsample_nearest_exact2d_backward", "upsample_bicubic2d",
                          "upsample_nearest2d_backward"))(_trailing(2))
register_rule(*_overloads("_upsample_nearest_exact1d", "upsample_linear1d",
                          "upsample_nearest1d"))(_trailing(1))
register_rule(*_overloads("_upsample_nearest_exact3d", "upsample_nearest3d",
                          "upsample_trilinear3d"))(_trailing(3))
register_rule(aten.max_pool3d_with_indices.default, aten.avg_pool3d.default,
              aten._adaptive_avg_pool3d.default, aten.adaptive_max_pool3d.default,
              aten.max_pool3d_with_indices_backward.default, aten.avg_pool3d_backward.default,
              aten._adaptive_avg_pool3d_backward.default,
              aten.adaptive_max_pool3d_backward.default)(_trailing(3))


@register_rule(aten._linalg_check_errors.default)
def _check_errors(call):
    # the per-matrix status codes are gathered (a few ints) so that a singular matrix on one
    # rank's shard makes every rank raise, none is left waiting in a later collective
    return [((), (R,))]
