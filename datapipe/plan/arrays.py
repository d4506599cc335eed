"""The array types plan/ computes with: int64 counts, positions and indices; uint64 keys;
boolean masks. Inputs that are converted on entry take anything array-like."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["ArrayLike", "Bools", "Int64s", "UInt64s"]

ArrayLike = npt.ArrayLike
Int64s = npt.NDArray[np.int64]
UInt64s = npt.NDArray[np.uint64]
Bools = npt.NDArray[np.bool_]
