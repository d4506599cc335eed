"""A tier out of the path that several threads of one process meet at once (the loader's
fetches, the cache's prefetches): its due probe is made by one of them, and its return is
counted and said once, however the threads interleave."""

from __future__ import annotations

import threading
import warnings

from datapipe.cache import TieredCache
from tests.folder_faults import ReadOnly


def test_two_threads_meeting_a_due_probe_take_the_tier_back_once(tmp_path):
    cold = tmp_path / "cold"
    cold.mkdir()
    urls = []
    for i in range(4):
        (cold / f"o{i}.bin").write_bytes(bytes([i]) * 3000)
        urls.append(str(cold / f"o{i}.bin"))
    warm = tmp_path / "warm"
    ro = ReadOnly(warm)
    c = TieredCache(warm_dir=warm, warm_bytes=1 << 20, tier_retry_s=0)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert c.read(urls[0]) == bytes([0]) * 3000
            ro.on()
            assert c.read(urls[1]) == bytes([1]) * 3000  # the fill fails, so does the probe: out
            ro.off()
            state = c._state()
            # the counters, not stats(): its use of the warm tier would probe it, due at once
            assert state.stats.snapshot()["warm_outs"] == 1
            tier = state.tiers.warm
            real_probe = tier.dir.probe
            # Each probe waits for the other thread to be probing too: where two threads may
            # probe at once they both do (and both took the tier back); where one probes at
            # a time the wait runs out, unmet, and the other thread, which does not wait for
            # the probe, reads around the tier while it is still out.
            both = threading.Barrier(2)

            def probe():
                try:
                    both.wait(timeout=2)
                except threading.BrokenBarrierError:
                    pass
                real_probe()

            tier.dir.probe = probe
            got: dict[int, bytes] = {}
            threads = [threading.Thread(target=lambda i=i: got.update({i: c.read(urls[i])})) for i in (2, 3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        s = c.stats()
    finally:
        ro.off()
        c.close()
    assert got == {2: bytes([2]) * 3000, 3: bytes([3]) * 3000}
    assert s["warm_outs"] == 1
    assert s["warm_backs"] == 1, {k: v for k, v in s.items() if k.startswith("warm") and v}
    back = [str(w.message) for w in caught if "back in the path" in str(w.message)]
    assert len(back) == 1, back
    assert s["warm_fills"] >= 2  # o0, then the prober's object once back
