"""The part transfers of a restore (restore.py's ``_send_replica`` to ``_recv_files``, a part
a resharding restore asked for, or to ``_recv_replica``, a rank's own part from its peer
replica) over a real 2-rank gloo group: a receiver that refuses the file list a sender
announced still takes every announced byte, so the sender's sends complete and the next
transfer over the same group arrives intact."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.ranks import free_port, spawn_ranks

STEP = 4
TAG = 7


def _ranks(rank: int, port: int, folder: str, receiver: str) -> None:
    from datapipe.checkpoint import restore
    from datapipe.checkpoint.format import manifest_key
    from datapipe.checkpoint.step import read_manifest
    from datapipe.errors import CheckpointError
    from datapipe.storage import MemoryStore, open_store

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = restore._Group(rank, 2, timeout_s=30)
    store = open_store(folder)
    attempt = read_manifest(store, STEP)["attempt"]
    try:
        for refuse in (True, False):
            if rank == 0:  # the real sender: manifest, part, three chunks of 1 MiB
                tag = 0 if receiver == "replica" and refuse else TAG  # a peer replica goes untagged
                reqs, err = restore._send_replica(group, 1, store, STEP, attempt, tag=tag)
                assert err is None, err
                # returns only once rank 1 took every byte (else: CheckpointError at the timeout)
                restore._wait_sends(reqs, 0, STEP, group.timeout_s)
            else:
                got = MemoryStore("received://")
                if refuse:  # here a part's files are at most 512 KiB: the chunks are refused
                    limit = restore.MAX_CHUNK_BYTES
                    restore.MAX_CHUNK_BYTES = -(1 << 19)  # (the receiver allows 1 MiB more)
                    try:
                        sizes = r"\[\d+, \d+, 1048576, 1048576, 1048576\]"  # manifest, part, chunks
                        with pytest.raises(CheckpointError,
                                           match=rf"rank 0 sent a file list of sizes that are not a {receiver}'s "
                                                 rf"\({sizes}\)"):
                            if receiver == "part":  # a part a resharding restore asked for
                                restore._recv_files(group, 0, TAG, got)
                            else:  # this rank's own part, from the peer replica its holder keeps
                                restore._recv_replica(group, 0, 1, 2, STEP, attempt, "replica", None)
                    finally:
                        restore.MAX_CHUNK_BYTES = limit
                    assert got.list("") == []  # nothing refused is kept
                else:  # the same group, in step: the next transfer arrives whole
                    restore._recv_files(group, 0, TAG, got)
                    keys = got.list("")  # manifest, part, chunks: each as stored
                    assert len(keys) == 5 and manifest_key(STEP) in keys, keys
                    assert all(got.get(k) == store.get(k) for k in keys)
            assert group.all_gather_json(rank) == [0, 1]
    finally:
        group.close()
    dist.destroy_process_group()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("receiver", ["part", "replica"])
def test_a_refused_file_list_is_still_received_so_the_sender_completes(tmp_path, receiver):
    from datapipe.checkpoint import CheckpointWriter

    folder = str(tmp_path / "part")
    with CheckpointWriter(folder, rank=0, world_size=1, background="thread") as w:
        w.save(STEP, {"w": torch.zeros(3 << 20, dtype=torch.uint8) + 1}).wait()
    spawn_ranks(_ranks, (free_port(), folder, receiver), 2)


def test_a_file_far_past_a_parts_largest_is_not_drained():
    """Memory stays bounded: a sender announcing a file of more than twice a part's largest
    is not received at all (its sends wait out the group's timeout), and nothing is posted."""
    from datapipe.checkpoint import restore
    from datapipe.checkpoint.format import MAX_CHUNK_BYTES

    why = restore._drain(None, 1, [10, 3 * MAX_CHUNK_BYTES])  # type: ignore[arg-type]  # no group: nothing may be received
    assert "not received" in why and str(3 * MAX_CHUNK_BYTES) in why
