"""The collector's pause of a load: :mod:`datapipe.gcpause` (a leaf, shared with the packer)."""

from ..gcpause import collections_paused

__all__ = ["collections_paused"]
