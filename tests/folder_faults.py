"""Folders that fail for real, for the tests of tiers taken out of the path: read-only
even for root (whom chmod does not stop: the immutable flag, ``chattr +i``), and replaced by
a file in one step."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

import pytest


class ReadOnly:
    """Make a folder tree refuse writes for real: ``chattr +i`` for root (chmod does not
    stop root), chmod for anyone else. Skips the test where neither works."""

    def __init__(self, path):
        self.path = str(path)
        self.root = os.geteuid() == 0

    def on(self):
        if self.root:
            r = subprocess.run(["chattr", "-R", "+i", self.path], capture_output=True)
            if r.returncode != 0:
                pytest.skip(f"chattr +i does not work here: {r.stderr.decode().strip()}")
        else:
            for d, _dirs, _files in os.walk(self.path):
                os.chmod(d, 0o555)
        check = os.path.join(self.path, ".read-only-check")
        try:
            open(check, "wb").close()
        except OSError:
            return
        os.unlink(check)
        self.off()
        pytest.skip(f"{self.path} cannot be made read-only here")

    def off(self, path=None):
        path = self.path if path is None else str(path)
        if self.root:
            subprocess.run(["chattr", "-R", "-i", path], capture_output=True)
        else:
            for d, _dirs, _files in os.walk(path):
                os.chmod(d, 0o755)

    def replace_by_file(self):
        """Remove the read-only folder and put a file at its path in one step (``renameat2``
        with ``RENAME_EXCHANGE``), so that the cache never finds the path free or the
        folder writable in between; the folder is then deleted."""
        if self.root:
            subprocess.run(["chattr", "-i", self.path], capture_output=True)  # the top only: movable
        blocker = self.path + ".file"
        with open(blocker, "wb") as f:
            f.write(b"not a folder")
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.renameat2(-100, os.fsencode(blocker), -100, os.fsencode(self.path), 2) != 0:  # AT_FDCWD
            err = ctypes.get_errno()
            self.off()
            pytest.skip(f"renameat2(RENAME_EXCHANGE) does not work here: {os.strerror(err)}")
        self.off(blocker)  # the old folder, now at the blocker's name
        shutil.rmtree(blocker)


def fill_up(path):
    """Write zeros to the file ``path`` until its file system refuses more (a full disk)."""
    with open(path, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
