"""Where FSDP's copies and collectives run: the only file that knows about CUDA streams.

The schedule is the same on every device: copy the shards in, *issue* the collective
asynchronously, and wait for its work handle only where the result is consumed (copy-out in
pre-forward / pre-backward) or where its buffers must go (a reduce-scatter is finished at the next
group's pre-backward, or at the end of backward). On CPU gloo runs the collectives on its own
threads, so a prefetched all-gather overlaps the current block's compute there too; FSDP's flat
collectives take gloo's in-place forms (``collectives.flat_all_gather``), so nothing in flight
holds a buffer beyond FSDP's own. Copies run in the caller's order.

On CUDA, copy-in and gradient packing run on two side streams so they overlap with compute, and
NCCL runs the collectives on its own stream, ordered after the side stream that issued them;
``work.wait()`` then orders the *current* stream after the collective: the compute stream for an
all-gather; for a reduce-scatter, its own side stream, which also divides and writes the
gradients (the compute stream joins it at the end of backward), so finishing it early costs the
compute stream nothing. Memory is kept
safe: a side stream always waits for the compute stream before it allocates (``side()`` below).
A buffer that was allocated on a side stream and read on the compute stream may be reused by the
caching allocator only for a later side-stream allocation, which by then is ordered after
everything the compute stream had queued -- including that read. The one buffer going the other
way is an unsharded gradient: made by autograd on the compute stream, packed into the
reduce-scatter input on its side stream and dropped right after (FSDP keeps no gradient beside
the next group's backward). Dropped bare, the compute stream could reuse its memory before the
queued packing copy has read it -- silently wrong gradients. ``read_by`` records it on the side
stream instead, so the allocator hands that memory out only once the copy ran.
"""
from __future__ import annotations

import contextlib

import torch

from dtensor_lite.collectives import free_now

__all__ = ["Streams"]


class Streams:
    """The side streams of one device (CPU: none; every method is a no-op)."""

    _shared: dict = {}

    @classmethod
    def shared(cls, device: torch.device) -> "Streams":
        """One set per device, shared by every FSDP group on it (streams are not free)."""
        key = str(device)
        if key not in cls._shared:
            cls._shared[key] = cls(device)
        return cls._shared[key]

    def __init__(self, device: torch.device):
        self.device = device
        self.is_cuda = device.type == "cuda"
        # When backward prefetches the next group's all-gather. CUDA: at the current group's
        # pre-backward (torch's schedule, FSDP1's BACKWARD_PRE): NCCL moves it beside the
        # group's backward kernels, worth its buffer. CPU: at the current group's post-backward
        # (FSDP1's BACKWARD_POST), once that group's parameters are freed and its gradients
        # packed. gloo's threads take the cores the backward computes on, so the earlier issue
        # bought no step time (benchmarks/fsdp_step.py, world 2: not slower), while its buffer
        # (one block) sat at the step's peak -- the first block's backward, where every
        # activation is still alive (benchmarks/memory.py, world 2, 4 layers: 35.7 -> 33.7 MiB).
        self.prefetch_at_pre_backward = self.is_cuda
        if self.is_cuda:
            # high priority: a copy-in that waits behind a long compute kernel delays the all-gather
            self._streams = {
                "all_gather": torch.cuda.Stream(device, priority=-1),
                "reduce_scatter": torch.cuda.Stream(device, priority=-1),
            }
            self._wait_instead: dict[str, object] = {}  # name -> event (set_post_optim_event)

    def wait_event_instead(self, name: str, event) -> None:
        """The next ``side(name)`` block waits for ``event`` instead of the compute stream
        (``None``: as usual). ``FSDPModule.set_post_optim_event``: the first all-gather of an
        iteration then need not wait for work queued after the optimizer step. Safe for memory
        as ``side`` is: every earlier read of FSDP's buffers on the compute stream (the previous
        iteration) was queued before the event. CPU: nothing to wait for, dropped."""
        if self.is_cuda:
            self._wait_instead[name] = event

    @contextlib.contextmanager
    def side(self, name: str):
        """Run the block on side stream ``name``, ordered after the compute stream's queued work
        (or after the event ``wait_event_instead`` left for it)."""
        if not self.is_cuda:
            yield
            return
        stream = self._streams[name]
        event = self._wait_instead.pop(name, None)
        if event is not None:
            stream.wait_event(event)
        else:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            yield

    def read_by(self, name: str, tensor: torch.Tensor):
        """``tensor``, allocated on the compute stream, was just read by work queued on side stream
        ``name`` and its last reference is about to go: its memory must not return to the compute
        stream before that work ran (the unsharded gradients packed for the reduce-scatter)."""
        if self.is_cuda:
            tensor.record_stream(self._streams[name])

    def release(self, tensor: torch.Tensor):
        """Free the memory of a buffer a finished collective used, now (``collectives.free_now``:
        without it a step's peak varied by a block, 35.7-39.8 MiB, from step to step)."""
        free_now(tensor)

    def join(self, name: str):
        """The compute stream waits for side stream ``name``'s queued work (its results are
        read next: the reduced gradients at the end of backward, or a copy-in that no
        collective followed, whose work handle would have ordered it)."""
        if self.is_cuda:
            torch.cuda.current_stream(self.device).wait_stream(self._streams[name])

    def synchronize_host(self):
        """Block the CPU until queued device work is done (device-to-host gradient copies)."""
        if self.is_cuda:
            torch.cuda.current_stream(self.device).synchronize()
