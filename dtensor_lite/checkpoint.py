"""Checkpoints that are complete or absent: ``torch.distributed.checkpoint``, published atomically.

``dcp.save`` writes straight into its directory: each rank rewrites its own files, and rank 0
writes ``.metadata`` at the end. A save over an existing checkpoint that dies part-way on one rank
leaves the old ``.metadata`` beside a mixture of new and old files, and that directory then loads
without any error as a mixture of both checkpoints (some rows new, some old). ``save`` here never
lets a reader see a half-written checkpoint:

1. every rank writes into ``<dir>.saving`` (rank 0 empties it first);
2. when DCP's save has returned -- every rank wrote its files and rank 0 wrote ``.metadata`` --
   rank 0 writes the marker ``.complete`` (every file's name and size) last, then publishes: the
   old ``<dir>`` is renamed to ``<dir>.old``, ``<dir>.saving`` to ``<dir>`` (each an atomic
   rename), and ``<dir>.old`` is removed;
3. every rank returns only after the publication, and raises if it failed.

A failed or killed save leaves ``<dir>`` as it was. ``load`` checks the directory first (rank 0
looks, every rank hears the verdict, so all raise together): it must hold the marker and every
file at the size the marker lists, or, for checkpoints written by plain ``dcp.save``, a readable
``.metadata`` and every byte range it points into. The error names the directory and what is
missing or short, instead of loading a mixture or failing deep in DCP with a bare ``EOFError``.

The files are ordinary DCP files: ``torch.distributed.checkpoint.load`` reads these checkpoints
(it ignores the marker), and ``load`` reads checkpoints that ``dcp.save`` wrote.

Example::

    >>> import dtensor_lite.checkpoint as dcp        # instead of torch.distributed.checkpoint
    >>> dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id="ckpt")
    >>> dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id="ckpt")
"""
from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist

__all__ = ["save", "load", "CheckpointError"]

MARKER = ".complete"  # written last: its presence means every rank's files are in place
METADATA = ".metadata"  # DCP's own index, written by rank 0 once every rank has written
SAVING, OLD = ".saving", ".old"  # suffixes of the staging directory and of the one replaced


class CheckpointError(RuntimeError):
    """A checkpoint directory is missing, incomplete or damaged, or a save did not complete."""


# ----------------------------------------------------------------------------- save
def save(state_dict: dict, *, checkpoint_id, planner=None) -> None:
    """``dcp.save(state_dict, checkpoint_id=...)``, published only once complete.

    Collective: every rank calls it with the same directory. If any rank fails (or dies: the
    others then raise at the process-group timeout), every rank raises ``CheckpointError`` and
    ``checkpoint_id`` still holds the previous checkpoint, if there was one.

    Example::

        >>> save({"model": get_model_state_dict(model)}, checkpoint_id="runs/step_100")
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    path = _directory(checkpoint_id, "save")
    staging = path + SAVING
    _agree(lambda: _prepare_staging(path, staging))
    try:
        dcp.save(state_dict, storage_writer=dcp.FileSystemWriter(staging), planner=planner,
                 no_dist=not _distributed())
    except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
        raise CheckpointError(
            f"saving checkpoint {path} failed ({type(exc).__name__}: {exc}); nothing was "
            f"published: {path} is as it was before this save (the partial files in {staging} "
            "are removed by the next save)") from exc
    _agree(lambda: _publish(staging, path))


def _prepare_staging(path: str, staging: str) -> None:
    if os.path.exists(path) and not _is_checkpoint_dir(path):
        raise CheckpointError(
            f"refusing to save into {path}: it exists and is not a checkpoint directory (holds "
            f"{sorted(os.listdir(path))[:5] if os.path.isdir(path) else 'a file'}); a save "
            "replaces the whole directory, so give it a directory of its own")
    if os.path.lexists(staging):
        shutil.rmtree(staging)  # what a failed save left behind
    os.makedirs(staging)


def _is_checkpoint_dir(path: str) -> bool:
    if not os.path.isdir(path):
        return False
    names = os.listdir(path)
    return not names or METADATA in names or MARKER in names or \
        all(n.endswith(".distcp") for n in names)


def _publish(staging: str, path: str) -> None:
    files = {name: os.path.getsize(os.path.join(staging, name))
             for name in sorted(os.listdir(staging))}
    if METADATA not in files:
        raise CheckpointError(f"saving checkpoint {path}: DCP returned but wrote no {METADATA} in "
                              f"{staging}; nothing was published")
    _write_synced(os.path.join(staging, MARKER), json.dumps({"files": files}, indent=1))
    old = path + OLD
    try:
        if os.path.lexists(old):
            shutil.rmtree(old)
        if os.path.exists(path):
            os.rename(path, old)
        os.rename(staging, path)
        _fsync_dir(os.path.dirname(path))
    except OSError as exc:
        raise CheckpointError(f"saving checkpoint {path}: every rank wrote its files to {staging} "
                              f"but publishing them failed ({exc}){_leftovers(path)}") from exc
    shutil.rmtree(old, ignore_errors=True)


def _write_synced(file: str, text: str) -> None:
    with open(file, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- load
def load(state_dict: dict, *, checkpoint_id, planner=None) -> None:
    """``dcp.load(state_dict, checkpoint_id=...)`` after checking the checkpoint is complete.

    Loads in place into the tensors of ``state_dict`` (DTensors on any mesh, or plain tensors in a
    single process). Raises ``CheckpointError`` on every rank, naming the directory and the
    missing or truncated file, before any data is read.

    Example::

        >>> model_sd, optim_sd = get_state_dict(model, opt)          # templates on this mesh
        >>> load({"model": model_sd, "optim": optim_sd}, checkpoint_id="runs/step_100")
    """
    import torch.distributed.checkpoint as dcp

    path = _directory(checkpoint_id, "load")
    _agree(lambda: _check_complete(path))
    dcp.load(state_dict, storage_reader=dcp.FileSystemReader(path), planner=planner,
             no_dist=not _distributed())


def _check_complete(path: str) -> None:
    if not os.path.isdir(path):
        why = "it is not a directory" if os.path.exists(path) else "it does not exist"
        raise CheckpointError(f"no checkpoint at {path}: {why}{_leftovers(path)}")
    names = set(os.listdir(path))
    if MARKER in names:
        _check_listed_files(path)
    elif METADATA in names:
        _check_metadata_ranges(path)  # written by plain dcp.save: trust its index, check sizes
    else:
        raise CheckpointError(
            f"incomplete checkpoint {path}: it has neither {METADATA} nor the {MARKER} marker "
            f"(holds {sorted(names)[:6]}): the save that wrote it did not finish. Load an earlier "
            f"checkpoint or save again{_leftovers(path)}")


def _leftovers(path: str) -> str:
    notes = []
    if os.path.isdir(path + OLD):
        notes.append(f"the previous checkpoint is intact at {path + OLD} (a save was interrupted "
                     f"while publishing: rename it back to {path})")
    if os.path.isdir(path + SAVING):
        notes.append(f"{path + SAVING} holds the files of a save that did not finish")
    return "; " + "; ".join(notes) if notes else ""


def _check_listed_files(path: str) -> None:
    try:
        with open(os.path.join(path, MARKER)) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {path}: its {MARKER} marker is unreadable "
                              f"({type(exc).__name__}: {exc})") from exc
    for name, size in files.items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CheckpointError(f"damaged checkpoint {path}: {file} is missing (the "
                                  f"{MARKER} marker lists it with {size} bytes)")
        actual = os.path.getsize(file)
        if actual != size:
            raise CheckpointError(
                f"damaged checkpoint {path}: {file} has {actual} bytes but was saved with {size} "
                "(truncated or overwritten after the save); load an earlier checkpoint")


def _check_metadata_ranges(path: str) -> None:
    """Every byte range DCP's index points into must exist (a killed writer leaves short files)."""
    import torch.distributed.checkpoint as dcp

    metadata_file = os.path.join(path, METADATA)
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as exc:
        raise CheckpointError(
            f"damaged checkpoint {path}: {metadata_file} cannot be read ({type(exc).__name__}: "
            f"{exc or 'no details'}); it was probably truncated by an interrupted save") from exc
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, end in sorted(needed.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CheckpointError(f"incomplete checkpoint {path}: {file} is missing ({METADATA} "
                                  "points into it): the save that wrote it did not finish")
        actual = os.path.getsize(file)
        if actual < end:
            raise CheckpointError(
                f"damaged checkpoint {path}: {file} has {actual} bytes but {METADATA} needs "
                f"{end} (truncated by an interrupted save?); load an earlier checkpoint")


# ----------------------------------------------------------------------------- coordination
def _directory(checkpoint_id, what: str) -> str:
    if not isinstance(checkpoint_id, (str, os.PathLike)):
        raise TypeError(f"{what}: checkpoint_id must be a directory path (str or PathLike), got "
                        f"{type(checkpoint_id).__name__}; for other storage use "
                        f"torch.distributed.checkpoint.{what} directly")
    return os.path.abspath(os.fspath(checkpoint_id))


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _agree(action) -> None:
    """Run ``action`` on rank 0; every rank raises its error (or none) together."""
    if not _distributed():
        action()
        return
    from . import collectives as C
    from .dtensor import default_mesh

    error = None
    if dist.get_rank() == 0:
        try:
            action()
        except Exception as exc:  # noqa: BLE001 -- re-raised on every rank below
            error = exc if isinstance(exc, CheckpointError) else CheckpointError(
                f"{type(exc).__name__}: {exc}")
    error = C.broadcast_object(error, default_mesh(torch.empty(0)), 0, 0)
    if error is not None:
        raise error
