"""Progress bars for long work (pack, index, verify): tqdm when asked for, else nothing.

A disabled ``tqdm`` still starts tqdm's monitor thread, and a process with a second thread
makes ``pack`` and ``datapipe index`` start their next worker pool with forkserver instead
of fork (slower, and scripts then need an ``if __name__ == "__main__"`` guard). So no
progress means no tqdm object at all.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

__all__ = ["progress_bar", "progress_iter", "polled_progress"]

T = TypeVar("T")


class _NoBar:
    """What the callers use of a tqdm bar, doing nothing."""

    def __init__(self) -> None:
        self.format_dict: dict[str, Any] = {"elapsed": 0.0}

    def update(self, n: float = 1) -> None:
        pass

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: float, enabled: bool, **options: Any) -> Any:
    """A tqdm bar of ``total`` (``options`` go to tqdm), or one that does nothing."""
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, **options)


def progress_iter(items: Iterable[T], enabled: bool, **options: Any) -> Iterator[T]:
    """``items``, with a tqdm bar when ``enabled``."""
    if not enabled:
        return iter(items)
    from tqdm import tqdm

    return iter(tqdm(items, **options))


@contextmanager
def polled_progress(bar: Any, counters: Any, postfix: Callable[[Any], str], enabled: bool,
                    name: str | None = None) -> Iterator[None]:
    """``bar`` kept up with ``counters[0]`` (shared counters that worker processes add to)
    by a thread that looks every 0.2 s and shows ``postfix(bar)`` beside it; on exit the
    thread stops, the bar takes the last count and is closed. No thread unless ``enabled``."""
    stop = threading.Event()

    def poll() -> None:
        last = 0
        while not stop.wait(0.2):
            cur = counters[0]
            bar.update(cur - last)
            last = cur
            bar.set_postfix_str(postfix(bar), refresh=False)
        bar.update(counters[0] - last)

    poller = threading.Thread(target=poll, daemon=True, name=name) if enabled else None
    if poller is not None:
        poller.start()
    try:
        yield
    finally:
        stop.set()
        if poller is not None:
            poller.join()
        bar.close()
