"""A local S3 endpoint on loopback: moto's threaded server, for tests, demos and benchmarks.

    with LocalS3() as s3:
        s3.create_bucket("data")
        datapipe.pack(src, "s3://data/ds", storage_options=s3.storage_options)

Only 127.0.0.1 is ever bound or contacted. Credentials are dummies.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["LocalS3"]

_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class LocalS3:
    def __init__(self, port: int = 0) -> None:
        self._port = port
        self._server: Any = None
        self.endpoint_url = ""

    def start(self) -> LocalS3:
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise

        for k, v in _ENV.items():
            os.environ.setdefault(k, v)
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self._port, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint_url = f"http://{host}:{port}"
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def __enter__(self) -> LocalS3:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def storage_options(self) -> dict[str, Any]:
        """fsspec/s3fs options that reach this endpoint."""
        return {
            "key": _ENV["AWS_ACCESS_KEY_ID"],
            "secret": _ENV["AWS_SECRET_ACCESS_KEY"],
            "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": "us-east-1"},
        }

    @property
    def env(self) -> dict[str, str]:
        """Environment variables that point boto/s3fs in child processes at this endpoint."""
        return {**_ENV, "AWS_ENDPOINT_URL": self.endpoint_url, "AWS_ENDPOINT_URL_S3": self.endpoint_url}

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=_ENV["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=_ENV["AWS_SECRET_ACCESS_KEY"],
            region_name="us-east-1",
        )

    def create_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return f"s3://{name}"
