"""Bad arguments to the storage layer's public pieces (storage options by prefix, the
writer lease, the shared-directory lease) are an ``OptionError`` (a ``DatapipeError`` and a
``ValueError``) naming what is wrong, never a bare ValueError or TypeError."""

from __future__ import annotations

import pytest

from datapipe.errors import DatapipeError, OptionError
from datapipe.storage import MemoryStore, SharedFileLease, WriterLease, set_storage_options


@pytest.mark.parametrize("prefix, options, says", [
    ("bucket/", {}, "URL prefix with a protocol"),
    (None, {}, "URL prefix with a protocol"),
    ("s3://bucket/", ["anon"], "dict of fsspec options by name"),
    ("s3://bucket/", {1: "x"}, "dict of fsspec options by name"),
    ("s3://bucket/", "anon=true", "dict of fsspec options by name"),
])
def test_storage_options_by_prefix_refuse_what_is_not_one(prefix, options, says):
    with pytest.raises(OptionError, match=says) as e:
        set_storage_options(prefix, options)
    assert isinstance(e.value, DatapipeError) and isinstance(e.value, ValueError)


@pytest.mark.parametrize("kwargs, says", [({"ttl": 0}, "ttl"), ({"ttl": "60"}, "ttl"), ({"wait": -1}, "wait")])
def test_a_writer_lease_refuses_bad_timings(kwargs, says):
    with pytest.raises(OptionError, match=says):
        WriterLease(MemoryStore(), "lease.json", **kwargs)


@pytest.mark.parametrize("timeout_s", [0, -1.5, "30"])
def test_a_shared_file_lease_refuses_a_bad_timeout(tmp_path, timeout_s):
    with pytest.raises(OptionError, match="timeout_s"):
        SharedFileLease(str(tmp_path / "x.lease"), timeout_s=timeout_s)
