"""Relayout between two separately launched jobs: a trainer job and an inference-engine job, each
started by its own ``torchrun`` (its own world, its own meshes), joined afterwards -- as verl,
slime, NeMo-RL and checkpoint-engine run them.

1. **Rendezvous.** Every rank of both jobs calls ``connect_jobs(address, role)``. The trainer
   job's rank 0 hosts a ``torch.distributed.TCPStore`` at ``address``; every other rank of both
   jobs is its client. Each side posts its world size; the joint numbering puts the trainer's
   ranks first (trainer rank r is joint rank r, engine rank r is ``T + r``).
2. **The group.** A ``ProcessGroupGloo`` over a ``PrefixStore`` of that store, with the joint
   numbering, joins the two sides: every byte of the sync moves over it through
   ``collectives.exchange_pieces`` (no transport of ours).
3. **Metadata, once per plan.** ``link.plan_relayout(my_model, **options)``: each side's rank 0
   posts its tensors' layouts (names, shapes, dtypes, mesh ranks, placements) and its options
   (``dtype``, ``fused``, ``name_map`` ...: the engine usually knows them, the trainer need not);
   every rank reads the other side's and plans with ``relayout.plan_relayout`` on both sides'
   *descriptions* in the joint numbering (``describe.MeshLayout``), so both sides derive the same
   plan -- the same minimum bytes as within one world. Options both sides give must agree.
   A plan that fails (names or shapes that differ: different models) fails alike on both sides;
   the sides then compare their plans' fingerprints, so differing plans raise on both.
4. **Run.** ``plan.run(my_model)``: one all-reduce over the joint group compares the
   fingerprints again (every rank), then the buckets move, then a closing all-reduce confirms
   both sides finished (a sender whose bytes sit in socket buffers learns of a receiver that
   died).

Nothing hangs: every wait on the store or the joint group is bounded by ``timeout``; a side that
never connects, dies or stops answering makes the other raise :class:`JobLinkError` naming that
side (its role, joint ranks and the rendezvous address).

Example (the engine job; the trainer passes ``role="trainer"`` and its FSDP model)::

    >>> link = connect_jobs("trainer-host:29600", role="engine", timeout=60)
    >>> plan = link.plan_relayout(engine_model, dtype=torch.bfloat16,
    ...                           fused={"qkv.weight": Concat(["q.weight", "k.weight",
    ...                                                        "v.weight"], per_rank=True)})
    >>> for step in range(steps):
    ...     plan.run(engine_model)      # the trainer calls plan.run(trainer_model) alike
"""
from __future__ import annotations

import datetime
import pickle

import torch
import torch.distributed as dist

from . import collectives as C
from .mesh_layout import MeshLayout
from .redistribute.cross_mesh import mesh_instances
from .relayout import RelayoutPlan, _spec_of, _tensors, plan_relayout
from .spec import DTensorSpec, TensorMeta, contiguous_stride

__all__ = ["JobLink", "JobLinkError", "CrossJobPlan", "connect_jobs"]

ROLES = ("trainer", "engine")  # the joint numbering: the trainer's ranks first


# what gloo says when the other side's socket closed (its process died)
_CLOSED = ("connection closed by peer", "connection reset by peer", "broken pipe")


class JobLinkError(RuntimeError):
    """The other job never connected, died, stopped answering, or planned differently."""


def _other(role: str) -> str:
    return ROLES[1 - ROLES.index(role)]


def connect_jobs(address: str, role: str, *, timeout: float = 60.0) -> "JobLink":
    """Join this job (already ``init_process_group``-ed by its own ``torchrun``) with the other
    one at the rendezvous ``address`` (``"host:port"``, a port neither job's own world uses).
    ``role``: ``"trainer"`` (its rank 0 hosts the store) or ``"engine"``. Every rank of both jobs
    calls it; it returns once the joint group is built, or raises :class:`JobLinkError` within
    about ``timeout`` seconds naming the side that did not come."""
    if role not in ROLES:
        raise ValueError(f"connect_jobs: role must be 'trainer' or 'engine', got {role!r}")
    if not dist.is_initialized():
        raise RuntimeError("connect_jobs: call dist.init_process_group first (each job has its "
                           "own world; the link joins two of them)")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"connect_jobs: address must be 'host:port', got {address!r}")
    rank, size = dist.get_rank(), dist.get_world_size()
    span = datetime.timedelta(seconds=timeout)
    hosting = role == "trainer" and rank == 0
    try:
        store = dist.TCPStore(host, int(port), is_master=hosting, wait_for_workers=False,
                              timeout=span)
    except (RuntimeError, TimeoutError) as e:
        raise JobLinkError(
            f"connect_jobs(role={role!r}, rank {rank}): "
            + (f"could not host the rendezvous store at {address}: {e}" if hosting else
               f"the rendezvous store at {address} (hosted by the trainer job's rank 0) did not "
               f"answer within {timeout:g} s: {e}. Start the trainer job, or check the address")
        ) from e
    link = JobLink(store, role, rank, size, address, timeout)
    link._connect()
    return link


class JobLink:
    """Two jobs joined: ``group`` (gloo, joint numbering), this rank's joint ``rank``, each
    side's size and joint ``offset``. Made by :func:`connect_jobs`."""

    def __init__(self, store, role: str, local_rank: int, local_size: int, address: str,
                 timeout: float):
        self.store, self.role, self.address, self.timeout = store, role, address, timeout
        self.local_rank, self.sizes = local_rank, {role: local_size}
        self.group = None
        self._round = 0

    # ------------------------------------------------------------------ set-up
    def _connect(self) -> None:
        if self.local_rank == 0:
            self.store.set(f"size/{self.role}", str(self.sizes[self.role]))
        other = _other(self.role)
        self.sizes[other] = int(self._await(f"size/{other}", "connect"))
        self.rank = self.offset + self.local_rank
        world = sum(self.sizes.values())
        try:
            self.group = dist.ProcessGroupGloo(
                dist.PrefixStore("dtensor_lite.jobs/group/", self.store), self.rank, world,
                datetime.timedelta(seconds=self.timeout))
        except RuntimeError as e:
            raise self._lost("join the joint process group", e) from e

    @property
    def offset(self) -> int:
        """The joint rank of this job's rank 0."""
        return 0 if self.role == "trainer" else self.sizes["trainer"]

    def ranks_of(self, role: str) -> range:
        start = 0 if role == "trainer" else self.sizes["trainer"]
        return range(start, start + self.sizes[role])

    def _lost(self, doing: str, error: BaseException | None = None) -> JobLinkError:
        other = _other(self.role)
        who = (f"the {other} job (joint ranks {self.ranks_of(other).start}-"
               f"{self.ranks_of(other).stop - 1})" if other in self.sizes else f"the {other} job")
        where = f"relayout across jobs ({self.role} rank {self.local_rank}, rendezvous " \
            f"{self.address})"
        if error is not None and any(s in str(error).lower() for s in _CLOSED):
            # the backend saw the other side's connection close: it died (no timeout ran out)
            return JobLinkError(f"{where}: {who} died -- its connection closed before it could "
                                f"{doing} ({error})")
        return JobLinkError(
            f"{where}: {who} did not {doing} within {self.timeout:g} s -- it never "
            f"connected, died or stopped answering" + (f" ({error})" if error else ""))

    def _await(self, key: str, doing: str) -> bytes:
        try:
            self.store.wait([key], datetime.timedelta(seconds=self.timeout))
            return self.store.get(key)
        except (RuntimeError, TimeoutError) as e:
            raise self._lost(doing, e) from e

    def _post_and_read(self, kind: str, payload) -> object:
        """This side's ``payload`` (posted by its rank 0) and the other side's, read by every
        rank: one exchange of metadata per round."""
        key = f"{kind}/{self._round}"
        if self.local_rank == 0:
            self.store.set(f"{key}/{self.role}", pickle.dumps(payload))
        return pickle.loads(self._await(f"{key}/{_other(self.role)}", f"post its {kind}"))

    # ------------------------------------------------------------------ describing
    def describe_side(self, model) -> dict:
        """{name: layout} of this side's tensors (a module or ``{name: DTensor or spec}``), in
        a form the other job can read (its meshes as rank lists in this job's numbering)."""
        out = {}
        for name, t in _tensors(model).items():
            spec = _spec_of(name, t)
            mesh = spec.mesh
            out[name] = (tuple(spec.shape), spec.dtype, mesh.device_type,
                         [i.tolist() for i in mesh_instances(mesh)],
                         getattr(mesh, "mesh_dim_names", None), spec.placements, spec.shard_order)
        return out

    def joint_specs(self, described: dict, role: str) -> dict:
        """``described`` (one side's :meth:`describe_side`) as specs over :class:`MeshLayout`s in
        the joint numbering (one layout per distinct mesh, so equal layouts share plans)."""
        shift = self.ranks_of(role).start
        layouts: dict = {}
        out = {}
        for name, (shape, dtype, device, instances, names, placements, order) in \
                described.items():
            key = (device, repr(instances))
            if key not in layouts:
                layouts[key] = MeshLayout(device, [torch.tensor(i) + shift for i in instances],
                                          names)
            meta = TensorMeta(torch.Size(shape), contiguous_stride(shape), dtype)
            out[name] = DTensorSpec(layouts[key], placements, meta, order)
        return out

    # ------------------------------------------------------------------ planning
    def plan_relayout(self, model, **options) -> "CrossJobPlan":
        """Plan moving the trainer's tensors into the engine's: this side's ``model`` (the
        trainer's or the engine's), the other side's read from the rendezvous. ``options`` as
        :func:`relayout.plan_relayout`'s; either side may give them (both: they must agree).
        Every rank of both jobs calls it, the same number of times in the same order."""
        self._round += 1
        try:
            mine = self.describe_side(model)
        except (TypeError, ValueError) as e:
            self._post_and_read("tensors", {"error": f"{type(e).__name__}: {e}"})
            raise
        theirs = self._post_and_read("tensors", {"tensors": mine})
        if "error" in theirs:
            raise JobLinkError(f"relayout across jobs: the {_other(self.role)} job could not "
                               f"describe its model: {theirs['error']}")
        specs = {self.role: self.joint_specs(mine, self.role),
                 _other(self.role): self.joint_specs(theirs["tensors"], _other(self.role))}
        options = self._agreed_options(options, specs["engine"])
        failed = None
        try:
            plan = plan_relayout(specs["trainer"], specs["engine"], **options)
            outcome = plan.fingerprint
        except (KeyError, ValueError, TypeError) as e:
            failed, outcome = e, f"{type(e).__name__}: {e}"
        other = self._post_and_read("outcome", outcome)
        if failed is not None:  # the other side planned the same metadata: it fails alike
            raise type(failed)(f"relayout across jobs ({self.role} side; the "
                               f"{_other(self.role)} side fails alike): {failed}") from failed
        if other != outcome:
            raise JobLinkError(
                f"relayout across jobs: the two jobs planned different relayouts (fingerprint "
                f"{outcome} on the {self.role} side, {other} on the {_other(self.role)} side); "
                "both must load the same models and agree on name_map, fused, dtype and "
                "bucket_bytes")
        plan.link = self
        return CrossJobPlan(plan, self, specs[_other(self.role)])

    def _agreed_options(self, options: dict, engine_specs: dict) -> dict:
        """Both sides' options, merged; a callable ``name_map`` becomes a dict over the
        destination names (which both sides know now) so it can travel."""
        unknown = set(options) - {"name_map", "fused", "dtype", "bucket_bytes"}
        if unknown:
            raise TypeError(f"relayout across jobs: unknown options {sorted(unknown)}")
        name_map = options.get("name_map")
        if callable(name_map):
            options = {**options, "name_map": {n: name_map(n) for n in engine_specs}}
        theirs = self._post_and_read("options", options)
        merged = dict(theirs)
        for key, value in options.items():
            if key in merged and merged[key] != value:
                raise ValueError(
                    f"relayout across jobs: the {self.role} job passed {key}={value!r} and the "
                    f"{_other(self.role)} job {key}={merged[key]!r}; give it on one side only, "
                    "or the same on both")
            merged[key] = value
        return merged

    # ------------------------------------------------------------------ joint collectives
    def all_reduce_max(self, values: list[int], doing: str) -> list[int]:
        """Max over every rank of both jobs, bounded by the link's timeout."""
        try:
            return C.all_reduce_max_over(self.group, values)
        except RuntimeError as e:
            raise self._lost(doing, e) from e

    def close(self) -> None:
        """Leave: both sides meet once more (the trainer's rank 0 hosts the store, so it must
        not go before the engine has read everything), then drop the group and the store."""
        if self.group is not None:
            self.all_reduce_max([0], "close the link")
        self.group = self.store = None


class CrossJobPlan:
    """A relayout planned across two jobs: ``report()`` (the dry run, same on both sides),
    ``run(my_model)`` on every rank of both jobs."""

    def __init__(self, plan: RelayoutPlan, link: JobLink, other_side: dict):
        self.plan, self.link, self.other_side = plan, link, other_side

    def report(self) -> str:
        return self.plan.report()

    def run(self, model) -> None:
        link, plan = self.link, self.plan
        both = link.all_reduce_max([plan.fingerprint, -plan.fingerprint], "start the sync")
        if both[0] != -both[1]:
            raise JobLinkError(
                f"relayout across jobs: ranks of the two jobs run different plans (fingerprint "
                f"{plan.fingerprint} here, from {-both[1]} to {both[0]} over both jobs); plan "
                "again on every rank of both jobs")
        src, dst = (model, self.other_side) if link.role == "trainer" else \
            (self.other_side, model)
        try:
            plan.run(src, dst, check=False)
        except RuntimeError as e:
            if isinstance(e, JobLinkError):
                raise
            raise link._lost("finish the sync", e) from e
        link.all_reduce_max([0], "confirm the sync")
