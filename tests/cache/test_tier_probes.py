"""Probing a tier that is out of the path: a probe of a hung mount stalls neither the other
readers nor the other tiers, and while an abandoned probe has not answered no other probe
of that tier starts; a tier back in the path says its next outage again.

A hung mount cannot be made without root over NFS or FUSE, so the hang is a gate: the
tier's own probe runs only once the test opens it (a real probe then runs, on a real
folder). Reads are real reads of real files; nothing is timed: a read that would wait on
the probe is detected by it not finishing while the gate is closed."""

from __future__ import annotations

import errno
import threading
import warnings

import pytest

from datapipe.cache import TieredCache
from datapipe.errors import CacheOptionError

SIZE = 256 << 10
BOUND = 60  # seconds a thread is waited for before the test says it is stuck (never reached when it passes)


def _objects(tmp_path, n):
    cold = tmp_path / "cold"
    cold.mkdir()
    urls = []
    for i in range(n):
        (cold / f"o{i}.bin").write_bytes(bytes([i]) * SIZE)
        urls.append(str(cold / f"o{i}.bin"))
    return urls


class Gate:
    """The tier's probe, held until :meth:`open` (a mount that hangs, then answers)."""

    def __init__(self, tier):
        self.real = tier.probe
        self.opened = threading.Event()
        self.entered = threading.Event()
        self.calls = 0
        self.lock = threading.Lock()
        tier.probe = self

    def __call__(self):
        with self.lock:
            self.calls += 1
        self.entered.set()
        if not self.opened.wait(BOUND):
            raise AssertionError("the gate was never opened")
        self.real()

    def open(self):
        self.opened.set()


def _out(cache):
    """The warm tier, taken out of the path (as a failed read and probe take it out)."""
    tiers = cache._state().tiers
    tiers.take_out(tiers.warm, OSError(errno.EIO, "a test took it out"))
    return tiers.warm


def test_a_hung_probe_stalls_no_other_reader(tmp_path):
    urls = _objects(tmp_path, 3)
    c = TieredCache(warm_dir=tmp_path / "warm", warm_bytes=64 << 20, tier_retry_s=0, tier_deadline_s=BOUND * 2)
    try:
        gate = Gate(_out(c))
        probing = threading.Thread(target=c.read, args=(urls[0],), daemon=True)
        probing.start()  # finds the probe due, and waits in it
        assert gate.entered.wait(BOUND)
        got: list[bytes] = []
        other = threading.Thread(target=lambda: got.append(c.read(urls[1])), daemon=True)
        other.start()
        other.join(BOUND)
        finished = not other.is_alive()
        gate.open()
        probing.join(BOUND)
        other.join(BOUND)
        assert finished, "a read waited for another thread's probe of a tier out of the path"
        assert got == [bytes([1]) * SIZE]
        assert gate.calls == 1  # the other read did not probe the tier again meanwhile
        st = c.stats()
        assert st["hot_from_cold"] >= 1 and st["warm_backs"] == 1
        assert c.read(urls[2]) == bytes([2]) * SIZE  # back in the path: filled there
        assert c.stats()["warm_fills"] >= 1
    finally:
        c.close()


def test_no_probe_starts_while_an_abandoned_one_has_not_answered(tmp_path):
    urls = _objects(tmp_path, 4)
    c = TieredCache(warm_dir=tmp_path / "warm", warm_bytes=64 << 20, tier_retry_s=0, tier_deadline_s=0.2)
    try:
        warm = _out(c)
        gate = Gate(warm)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert c.read(urls[0]) == bytes([0]) * SIZE  # its probe is abandoned: served from cold
            assert c.read(urls[1]) == bytes([1]) * SIZE  # due again, but the probe has not answered
            assert gate.calls == 1, "a second probe was piled behind the one still hung"
            assert c.stats()["warm_probes_failed"] == 1
            gate.open()  # the mount answers: the abandoned probe ends, and the tier may be probed
            done = threading.Event()
            for _ in range(BOUND * 20):
                if not warm.probing:
                    done.set()
                    break
                done.wait(0.05)
            assert done.is_set(), "the abandoned probe never let go of its claim"
            assert c.read(urls[2]) == bytes([2]) * SIZE
        st = c.stats()
        assert gate.calls == 2 and st["warm_backs"] == 1
    finally:
        c.close()


def test_a_timed_out_call_is_passed_over_even_after_another_thread_took_the_tier_back(tmp_path):
    c = TieredCache(warm_dir=tmp_path / "warm", warm_bytes=64 << 20, tier_retry_s=0)
    try:
        warm = c._state().tiers.warm
        assert warm.retry_at is None  # in the path: another thread's probe passed meanwhile
        # the read that was abandoned reads on from the tiers below instead of raising
        assert warm.broken(OSError(errno.ETIMEDOUT, "a read of it: no answer within 30 s; abandoned"))
    finally:
        c.close()


def test_a_second_outage_is_said_again_and_so_is_its_recovery(tmp_path):
    urls = _objects(tmp_path, 1)
    c = TieredCache(warm_dir=tmp_path / "warm", warm_bytes=64 << 20, tier_retry_s=0)
    try:
        tiers = c._state().tiers
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                tiers.hung(tiers.warm, OSError(errno.ETIMEDOUT, "no answer"))
                assert c.read(urls[0]) == bytes([0]) * SIZE  # the probe passes: back in the path
    finally:
        c.close()
    said = [str(w.message) for w in caught]
    assert sum("does not answer" in m for m in said) == 2, said
    assert sum("answers again" in m for m in said) == 2, said


def test_the_loaders_reads_of_a_pinned_copy_count_for_the_slow_tier_rule(tmp_path):
    urls = _objects(tmp_path, 4)
    # a floor no disk reaches: the warm tier is slow as soon as one window of reads closes
    c = TieredCache(warm_dir=tmp_path / "warm", warm_bytes=64 << 20, tier_retry_s=3600, tier_min_mb_s=1e9,
                    tier_window_bytes=4 * SIZE)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for u in urls:
                path = c.pin_or_read(u)
                assert isinstance(path, str)
                try:
                    with open(path, "rb") as f:
                        data = f.read()
                finally:
                    c.release(u)
                c.note_read(u, len(data), 1.0)  # 256 KiB a second: the reader timed it
        st = c.stats()
    finally:
        c.close()
    slow = [str(w.message) for w in caught if "is slow" in str(w.message)]
    assert len(slow) == 1 and str(tmp_path / "warm") in slow[0], [str(w.message) for w in caught]
    assert st["warm_slow"] == 1 and st["warm_outs"] == 1


@pytest.mark.parametrize("kw", [{"nbytes": -1, "seconds": 1.0}, {"nbytes": 1.5, "seconds": 1.0},
                                {"nbytes": 10, "seconds": float("nan")}, {"nbytes": 10, "seconds": -1}])
def test_note_read_refuses_bad_arguments(tmp_path, kw):
    c = TieredCache(warm_dir=tmp_path / "warm", warm_bytes=64 << 20)
    try:
        with pytest.raises(CacheOptionError) as e:
            c.note_read("x", **kw)
        assert ("nbytes" if kw["nbytes"] != 10 else "seconds") in str(e.value)
    finally:
        c.close()
