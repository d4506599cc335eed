"""The peer link: a rank's staged part goes to its peer on the next node over a gloo
process group of the writer's own, and the part of the rank whose replica it keeps comes
back the same way.

Why torch.distributed and not a shared filesystem: a node-local tier is a disk only its
node sees (NVMe), so its bytes must cross the network to survive the node; a job that has
a filesystem every node sees can name it as a shared tier instead. The group is gloo even
on NCCL jobs (the staged bytes are in host memory) and is created at the writer's
construction, the one moment all ranks call into the writer together; afterwards only
the writers' background threads use it, never the training group.

Messages (each rank sends to ``peer_of(rank)`` and receives from ``source_of(rank)``, in
the same order on every rank): sizes ``int64[2] = (header bytes, data bytes)``, the
header (JSON: step, attempt, rank, world size, tree, leaves, chunk size and the raw
checksum of every chunk: persist.replica_header, the same for both writers), then the
data. The receiver checks the header names the save it is making and every chunk against
the sender's checksum before it writes the replica; a header without them is refused. A
writer process (writer_process.py) runs the exchange in a thread of the training process (gloo's
send and receive run without the GIL) into a shared receive buffer; that thread hashes
the staged chunks for the header 1 MiB per GIL hold, and the writer process reuses those
checksums for its own copy.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

from ..errors import CheckpointError
from .format import MAX_PART_BYTES
from .tiers import peer_of, source_of

__all__ = ["PeerLink", "MAX_REPLICA_BYTES"]

MAX_REPLICA_BYTES = 1 << 44  # a bound on what a header may announce, so a bad one cannot allocate the host away


class PeerLink:
    """This rank's end of the replica exchange. Create on every rank at once (a collective)."""

    def __init__(self, rank: int, world_size: int, ranks_per_node: int, timeout_s: float) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise CheckpointError(
                "replicate=1 sends each rank's part to its peer over torch.distributed: call "
                "torch.distributed.init_process_group before creating the CheckpointWriter"
            )
        self.rank, self.world_size = rank, world_size
        self.peer = peer_of(rank, world_size, ranks_per_node)
        self.source = source_of(rank, world_size, ranks_per_node)
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self._recv_buf: Any = None  # reused across saves, grown only for a larger part
        # where received parts go instead (receive_into): a function of the byte count returning
        # a uint8 tensor at least that long (the writer process's shared receive buffer)
        self._recv_alloc: Any = None
        self.broken: str | None = None  # set when an exchange failed half way: the stream is out of step

    def receive_into(self, alloc: Any) -> None:
        """Receive parts into ``alloc(n)`` (a uint8 tensor of at least ``n`` bytes, e.g. the
        shared memory a writer process maps) instead of a buffer of the link's own."""
        self._recv_alloc = alloc

    def close(self) -> None:
        """Destroy the link's gloo group (its sockets and threads); idempotent."""
        import torch.distributed as dist

        group, self.group = self.group, None
        if group is not None and dist.is_initialized():
            dist.destroy_process_group(group)

    def exchange(self, header: dict[str, Any], data: Any) -> tuple[dict[str, Any], memoryview]:
        """Send ``header`` and ``data`` (a torch uint8 tensor) to the peer; return the
        source rank's header and data (a view of the reused receive buffer, valid until
        the next exchange). After a failed exchange the link is ``broken``: later calls
        still exchange, sending a header with ``no_data`` (the reason) and no data; a
        received header with ``no_data`` means the source sent none."""
        import torch
        import torch.distributed as dist

        if self.broken is not None:
            # Still take part in the exchange, with a header saying there is no data: the
            # peer waits in its receive, and a rank that stayed silent would break its link
            # too (and so on around the ring) after the timeout.
            header = dict(header, no_data=f"the replica link of rank {self.rank} broke earlier ({self.broken})")
            data = torch.empty(0, dtype=torch.uint8)
        try:
            hdr = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8)
            sizes = torch.tensor([hdr.numel(), data.numel()], dtype=torch.int64)
            g, peer, src = self.group, self.peer, self.source
            reqs: list[Any] = [dist.isend(sizes, peer, group=g), dist.isend(hdr, peer, group=g)]
            if data.numel():
                reqs.append(dist.isend(data, peer, group=g))
            in_sizes = torch.empty(2, dtype=torch.int64)
            dist.recv(in_sizes, src, group=g)
            nh, nd = int(in_sizes[0]), int(in_sizes[1])
            if not (0 < nh <= MAX_PART_BYTES and 0 <= nd <= MAX_REPLICA_BYTES):
                raise CheckpointError(f"rank {src} announced a replica of {nh} header and {nd} data bytes")
            in_hdr = torch.empty(nh, dtype=torch.uint8)
            dist.recv(in_hdr, src, group=g)
            if self._recv_alloc is not None:
                self._recv_buf = self._recv_alloc(nd)
            elif self._recv_buf is None or self._recv_buf.numel() < nd:
                self._recv_buf = None
                self._recv_buf = torch.empty(max(nd, 1), dtype=torch.uint8)
            if nd:
                dist.recv(self._recv_buf[:nd], src, group=g)
            for r in reqs:
                r.wait()
        except Exception as e:
            self.broken = f"{type(e).__name__}: {e}"
            raise CheckpointError(
                f"rank {self.rank}: exchanging replicas with ranks {self.peer} (to) and {self.source} "
                f"(from) failed ({type(e).__name__}: {e}); is every rank saving the same steps?"
            ) from e
        try:
            got = json.loads(bytes(in_hdr.numpy()))
        except ValueError as e:
            raise CheckpointError(f"rank {self.rank}: the replica header from rank {src} is not JSON ({e})") from None
        if not isinstance(got, dict):
            raise CheckpointError(f"rank {self.rank}: the replica header from rank {src} is not an object")
        return got, self._recv_buf.numpy()[:nd].data
