"""Rank processes for the multi-rank tests (torch.distributed over gloo on loopback).

``spawn_ranks`` is ``torch.multiprocessing.spawn`` with the forkserver start method: each
rank is forked from a server process that imported torch once (``conftest.py`` asks every
test process's forkserver to preload it), where a spawned rank imports torch anew (2.7 s of
CPU each on this machine, about a sixth of the whole suite's CPU). The ranks are still fresh
processes of their own, with nothing of the test process's state: the forkserver is started
clean and forks before any test code has run in it.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

__all__ = ["free_port", "spawn_ranks", "PRELOAD"]

#: what every test process's forkserver imports before it forks (set in conftest.py)
PRELOAD = ["__main__", "torch", "torch.distributed", "numpy"]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_ranks(fn: Callable[..., Any], args: tuple[Any, ...], nprocs: int) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` processes and wait for all; a rank that fails
    raises here (``torch.multiprocessing.ProcessRaisedException``), as ``mp.spawn`` does."""
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")
