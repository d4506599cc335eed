"""Storage options by URL prefix: a prefix matches whole path segments, and a malformed
environment value is named without echoing it (it holds credentials)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _own_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DATAPIPE_CACHE_DIR", str(tmp_path / "user-cache"))


# --- storage options: a prefix matches at a path boundary ----------------------------------


def test_storage_option_prefixes_match_whole_path_segments():
    """``s3://bucket`` matched ``s3://bucket-public/...`` (another bucket got its endpoint and
    keys), and ``s3://bucket/`` did not match the bucket's own root ``s3://bucket``."""
    from datapipe.storage import options, set_storage_options, storage_options_for

    try:
        set_storage_options("s3://data", {"key": "data"})
        set_storage_options("s3://logs/", {"key": "logs"})
        set_storage_options("s3://", {"key": "any"})
        assert storage_options_for("s3://data/x.tar") == {"key": "data"}
        assert storage_options_for("s3://data") == {"key": "data"}
        assert storage_options_for("s3://data-public/x.tar") == {"key": "any"}
        assert storage_options_for("s3://logs") == {"key": "logs"}
        assert storage_options_for("s3://logs/a/b") == {"key": "logs"}
        assert storage_options_for("s3://logsx/a") == {"key": "any"}
        assert storage_options_for("gs://data/x") == {}
    finally:
        options._set.clear()


# --- storage options: a malformed environment value is not echoed (it holds credentials) ----


@pytest.mark.parametrize("text", ['{"s3://b/": "secret-key-AKIA123"}', '["secret-key-AKIA123"]',
                                  '{"s3://b/": {"key": "secret-key-AKIA123"}, "b/": {}}'])
def test_a_malformed_environment_value_is_named_without_echoing_it(monkeypatch, text):
    """The error quoted the first 200 characters of DATAPIPE_STORAGE_OPTIONS: keys and
    secrets went into logs and tracebacks."""
    from datapipe.errors import StorageError
    from datapipe.storage import storage_options_for

    monkeypatch.setenv("DATAPIPE_STORAGE_OPTIONS", text)
    with pytest.raises(StorageError, match="DATAPIPE_STORAGE_OPTIONS") as e:
        storage_options_for("s3://b/x")
    assert "secret-key" not in str(e.value)
