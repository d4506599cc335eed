import uuid

import pytest

from tools.s3_endpoint import LocalS3


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on 127.0.0.1, one per test session."""
    with LocalS3() as server:
        yield server


@pytest.fixture
def s3(s3_server):
    """A fresh bucket on the loopback S3 server; yields (root URL, storage_options)."""
    bucket = f"t-{uuid.uuid4().hex[:12]}"
    root = s3_server.create_bucket(bucket)
    return root, s3_server.storage_options
