"""What every stage of a pass shares: how far the consumer got, and the one error policy.

- :class:`Progress`: plan steps the consumer has taken in the running pass; the stage that
  hands an item out (the read stage, the decode stage with map threads, the batch stage for
  columnar batches) sets it just before it does, so a resume state taken between two items
  is exact.
- :class:`ErrorPolicy`: the dataset's ``on_error``, applied where a sample is produced;
  :class:`Skipped` is the marker that takes a skipped sample's place, :func:`skip_report`
  the warning that reports the skips of a pass.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from ..errors import CorruptIndexError, DatapipeError, MissingDependencyError

__all__ = ["ErrorPolicy", "Progress", "Skipped", "skip_report", "split_skipped"]


class Skipped(NamedTuple):
    """A skipped sample's place in the stream, yielded instead of the sample only while a
    :class:`~datapipe.loader.StreamingDataLoader` iterates (it takes it out of the batch and
    reports it in the main process): batches stay aligned with the plan's batches, so the
    loader's resume count stays exact with worker processes."""

    url: str
    key: str | None
    why: str


def split_skipped(items: Iterable[Any]) -> tuple[list[Any], tuple[Skipped, ...]]:
    """(the items that are samples, the :class:`Skipped` markers among them), in order."""
    samples: list[Any] = []
    skipped: list[Skipped] = []
    for x in items:
        (skipped if x.__class__ is Skipped else samples).append(x)
    return samples, tuple(skipped)


class Progress:
    """Plan steps the consumer has taken in the current pass (skipped samples count too):
    the stage that hands an item out sets :attr:`steps` to its step just before."""

    __slots__ = ("steps",)

    def __init__(self, steps: int = 0) -> None:
        self.steps = steps


class ErrorPolicy:
    """The dataset's ``on_error``, applied in this one place: ``policy(url, key, error)``
    re-raises ``error`` ("raise"), or records ``(url, key, why)`` in ``skipped`` and returns
    the :class:`Skipped` marker that takes the sample's place ("skip")."""

    def __init__(self, skip: bool, skipped: list[tuple[str, str | None, str]]) -> None:
        self.skip = skip
        self.skipped = skipped

    def __call__(self, url: str, key: str | None, error: BaseException, why: str | None = None) -> Skipped:
        if not self.skip or not isinstance(error, DatapipeError) \
                or isinstance(error, (CorruptIndexError, MissingDependencyError)):
            raise error  # an index that fails, a package missing: not one sample's fault, never skipped
        marker = Skipped(url, key, str(error) if why is None else why)
        self.skipped.append((marker.url, marker.key, marker.why))
        return marker


def skip_report(skipped: Sequence[tuple[str, str | None, str]], where: str = "") -> str:
    """The warning for samples skipped in a pass: how many, the first five, ``where``."""
    shown = "; ".join(f"{u} {k!r}: {why}" for u, k, why in skipped[:5])
    more = f" (and {len(skipped) - 5} more)" if len(skipped) > 5 else ""
    return f"StreamingDataset skipped {len(skipped)} unreadable or undecodable samples: {shown}{more}{where}"
