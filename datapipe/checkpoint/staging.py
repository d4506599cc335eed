"""Host staging: one reused, already-touched byte buffer that a save copies the state into.

Fresh memory is slow (every first touch of a page faults), a copy into touched memory is
fast, so the buffer lives as long as the writer and is only regrown when a larger state
arrives. For a layout seen before, the per-leaf destination views are cached too, so a
save is one ``copy_`` per leaf and nothing else. Tensors on an accelerator are copied
into a pinned buffer on a side stream.

Layout: leaves back to back in state order, each at an offset aligned to ``ALIGN``;
padding bytes are zero so the stored bytes depend only on the state.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
import warnings
from typing import Any

import numpy as np

from ..errors import CheckpointError, CheckpointOptionError
from .leaf import Leaf, torch_copyable, torch_dtype_from_name

__all__ = ["ALIGN", "StagingBuffer", "plan_layout"]

ALIGN = 64


def plan_layout(leaves: list[Leaf]) -> tuple[list[int], int]:
    """Offsets of each leaf and the total byte count."""
    offsets, pos = [], 0
    for leaf in leaves:
        pos = (pos + ALIGN - 1) // ALIGN * ALIGN
        offsets.append(pos)
        pos += leaf.nbytes
    return offsets, pos


def _layout_key(leaves: list[Leaf]) -> tuple[Any, ...]:
    return tuple((leaf.kind, leaf.dtype, leaf.shape) for leaf in leaves)


def memfd_tensor(name: str, n: int) -> tuple[int, Any]:
    """``(fd, tensor)``: a new memfd of ``max(n, 1)`` bytes and a torch uint8 tensor over its
    mapping; the caller owns the fd (another process maps the same bytes by it)."""
    import torch

    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, max(n, 1))
        return fd, torch.frombuffer(mmap.mmap(fd, max(n, 1)), dtype=torch.uint8)
    except BaseException:
        os.close(fd)
        raise


def _register_pinned(buf: Any) -> bool:
    """Register a shared buffer's pages with CUDA as pinned memory (``cudaHostRegister``),
    so that device-to-host copies into it run at pinned speed; False (and a warning) where
    CUDA refuses."""
    import torch

    if not torch.cuda.is_available():
        return False
    try:
        err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 0)  # type: ignore[no-untyped-call]  # torch leaves cudart() untyped
        ok = int(getattr(err, "value", err)) == 0
    except Exception as e:  # an old or partial CUDA runtime binding
        ok, err = False, e
    if not ok:
        warnings.warn(f"checkpoint staging: CUDA would not pin the {buf.numel()} bytes of shared staging memory "
                      f"({err}); copies from the device go through unpinned memory, at a fraction of the "
                      "speed (CheckpointWriter(background='thread') stages into pinned memory)", stacklevel=4)
    return ok


def _unregister_pinned(buf: Any) -> None:
    import torch

    try:
        torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())  # type: ignore[no-untyped-call]  # as above
    except Exception:  # the process is tearing CUDA down; the mapping goes with it
        pass


class StagingBuffer:
    """The reused host buffer of one writer. Not thread-safe: the writer guarantees that
    a copy-in never overlaps the background thread reading the previous contents."""

    def __init__(self, max_bytes: int | None = None, shared: bool = False) -> None:
        if max_bytes is not None and max_bytes <= 0:
            raise CheckpointOptionError(f"max_staging_bytes must be positive, got {max_bytes}")
        self.max_bytes = max_bytes
        # shared: the buffer is a memfd mapping a writer process maps too (fd, buffer_id)
        self.shared = shared
        self.fd: int | None = None
        self.buffer_id = 0
        self._buf: Any = None  # torch uint8 tensor
        self._np: np.ndarray[Any, np.dtype[np.uint8]] | None = None  # the same bytes, as numpy
        self.pinned = False
        self._cannot_pin = False  # a shared buffer that CUDA would not register: not asked again
        self._key: tuple[Any, ...] | None = None
        self._views: list[Any] = []
        self._all_offsets: list[int] = []  # of the cached layout (views); offsets/total: of the last staged
        self._all_total = 0
        self.offsets: list[int] = []
        self.total = 0
        self.allocations = 0  # host buffers taken so far: a reused buffer keeps it unchanged
        self._lock = threading.Lock()  # prepare() may run in its own thread

    @property
    def capacity(self) -> int:
        return 0 if self._buf is None else int(self._buf.numel())

    def _check_budget(self, total: int) -> None:
        if self.max_bytes is not None and total > self.max_bytes:
            raise CheckpointError(
                f"the state needs {total} bytes of staging, more than max_staging_bytes="
                f"{self.max_bytes}; raise the limit or save a smaller state"
            )

    def _reserve(self, total: int, pinned: bool, touch: bool) -> None:
        import torch

        if (self._buf is not None and self.capacity >= total
                and (self.pinned or not pinned or (self.shared and self._cannot_pin))):
            return
        self._drop()  # free the old buffer before taking the new one
        if self.shared:
            # A memfd, not named shared memory: nothing in /dev/shm outlives a crash, and
            # the writer process gets the mapping by its fd.
            try:
                fd, buf = memfd_tensor("datapipe-ckpt-staging", total)
            except OSError as e:
                raise CheckpointError(
                    f"cannot make {total} bytes of shared staging memory for the checkpoint writer process ({e}; "
                    "a memfd counts against the file size limit, ulimit -f); use CheckpointWriter(background='thread')"
                ) from None
            self.fd = fd
            self.buffer_id += 1
            # pinned for the copies from the device: registered in place (a pinned
            # allocation could not be shared with the writer process)
            if pinned:
                pinned = _register_pinned(buf)
                self._cannot_pin = not pinned
        else:
            # Plain (not MAP_POPULATE'd) memory: on a first save the copy's page faults are
            # taken by all of torch's copy threads at once, which measured faster here than
            # the kernel populating the mapping on one thread.
            buf = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=pinned)
        if touch:
            buf.zero_()  # fault every page in now, not during a save
        self._buf, self.pinned = buf, pinned
        self.allocations += 1
        self._np = buf.numpy()

    def _build_views(self, leaves: list[Leaf], offsets: list[int], total: int) -> None:
        views: list[Any] = []
        prev_end = 0
        buf, npbuf = self._buf, self._np
        if npbuf is None:
            raise CheckpointError("staging views requested before the staging buffer was reserved")
        for leaf, off in zip(leaves, offsets):
            if off > prev_end:
                buf[prev_end:off].zero_()
            prev_end = off + leaf.nbytes
            raw = buf[off : off + leaf.nbytes]
            if leaf.kind == "torch":
                dt = torch_dtype_from_name(leaf.dtype, leaf.path)
                # dtypes without a copy kernel are staged as their raw bytes
                views.append(raw.view(dt).view(leaf.shape) if torch_copyable(dt) else raw)
            else:
                views.append(npbuf[off : off + leaf.nbytes].view(np.dtype(leaf.dtype)).reshape(leaf.shape))
        self._views = views
        self._all_offsets, self._all_total = offsets, total
        self.offsets, self.total = offsets, total

    def prepare(self, leaves: list[Leaf]) -> float:
        """Allocate and touch the buffer for this layout, build its views; returns seconds."""
        t0 = time.perf_counter()
        offsets, total = plan_layout(leaves)
        self._check_budget(total)
        with self._lock:
            pinned = any(leaf.device.startswith("cuda") for leaf in leaves)
            if not pinned and any(leaf.device == "meta" for leaf in leaves):
                import torch

                # a layout says nothing about the device: on a GPU machine, pin for it
                pinned = torch.cuda.is_available()
            self._reserve(total, pinned, touch=True)
            self._build_views(leaves, offsets, total)
            self._key = _layout_key(leaves)
        return time.perf_counter() - t0

    def stage(self, leaves: list[Leaf]) -> None:
        """Copy every leaf into the buffer. Returns once the bytes are in host memory."""
        import torch

        key = _layout_key(leaves)
        with self._lock:
            n = len(key)
            if self._key is None or key != self._key[:n]:
                offsets, total = plan_layout(leaves)
                self._check_budget(total)
                pinned = any(leaf.device.startswith("cuda") for leaf in leaves)
                # First save of a layout: no separate touch, the copy faults the pages in once.
                self._reserve(total, pinned, touch=False)
                self._build_views(leaves, offsets, total)
                self._key = key
            # A prefix of the cached layout has the same offsets: a save without a node-local
            # tier due stages the leaves of one with it minus the copies at the end (writer.py),
            # and reuses its views instead of building them again at every other save.
            views = self._views[:n]
            self.offsets = self._all_offsets[:n]
            if n == len(self._key or ()):
                self.total = self._all_total
            else:
                self.total = self.offsets[-1] + leaves[-1].nbytes if n else 0
            with torch.no_grad():
                cuda = [i for i, leaf in enumerate(leaves) if leaf.kind == "torch" and leaf.obj.device.type == "cuda"]
                if cuda:
                    self._stage_cuda(leaves, views, cuda)
                for leaf, dst in zip(leaves, views):
                    if leaf.kind == "torch":
                        if leaf.obj.device.type == "cuda":
                            continue
                        if dst.dtype is leaf.obj.dtype:
                            dst.copy_(leaf.obj)
                        else:
                            dst.copy_(leaf.obj.contiguous().view(torch.uint8).reshape(-1))
                    else:
                        np.copyto(dst, leaf.obj, casting="no")

    @staticmethod
    def _stage_cuda(leaves: list[Leaf], views: list[Any], idx: list[int]) -> None:
        import torch

        # A side stream that first waits for the training stream, so the copies see the
        # latest values; we wait for it before returning, so training may then overwrite.
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # torch leaves Stream() unannotated
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in idx:
                views[i].copy_(leaves[i].obj, non_blocking=True)
        side.synchronize()

    def _drop(self) -> None:
        if self._buf is not None and self.shared and self.pinned:
            _unregister_pinned(self._buf)  # before its pages are unmapped
        self._buf = self._np = None
        self.pinned = False
        self._key, self._views = None, []
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def close(self) -> None:
        """Drop the buffer (and its memfd)."""
        with self._lock:
            self._drop()

    def tensor(self, end: int) -> Any:
        """The staged bytes ``[0, end)`` as a torch uint8 tensor without a copy (what the
        peer link sends)."""
        if self._buf is None or end > self.total:
            raise CheckpointError(f"staging range [0, {end}) outside the staged {self.total} bytes")
        return self._buf[:end]

    def view(self, start: int, end: int) -> memoryview:
        """The staged bytes ``[start, end)`` without a copy."""
        if self._np is None or end > self.total:
            raise CheckpointError(f"staging range [{start}, {end}) outside the staged {self.total} bytes")
        return self._np[start:end].data
