"""A real S3-protocol server on loopback for the object-store tests: moto's ``ThreadedMotoServer`` (moto 5.2, the
S3 API in memory, served over HTTP by werkzeug in a thread of the test process), with one bucket made through the
S3 API itself. Its limits: one process's memory, no persistence across its own restart, single-region, no real
IAM (any key is accepted), eventual consistency never simulated (docs/scale-out.md)."""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from rr_server.launch.process import free_port

KEYS = {"AWS_ACCESS_KEY_ID": "rr-test", "AWS_SECRET_ACCESS_KEY": "rr-test-secret", "AWS_DEFAULT_REGION": "us-east-1"}


@dataclass(frozen=True)
class S3:
    """A running S3-protocol server: its endpoint and a bucket in it."""

    endpoint: str
    bucket: str

    @property
    def storage_options(self) -> dict[str, Any]:
        """fsspec/s3fs options for a process of the test's own (the test's credentials, this endpoint)."""
        return {
            "endpoint_url": self.endpoint,
            "key": KEYS["AWS_ACCESS_KEY_ID"],
            "secret": KEYS["AWS_SECRET_ACCESS_KEY"],
        }

    @property
    def env(self) -> dict[str, str]:
        """The environment a server process reaches it with (fsspec's own configuration variables and AWS's)."""
        return {**KEYS, "FSSPEC_S3_ENDPOINT_URL": self.endpoint}

    def url(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix.strip('/')}"

    def filesystem(self) -> Any:
        import s3fs

        return s3fs.S3FileSystem(**self.storage_options, skip_instance_cache=True)


@contextmanager
def s3_server(bucket: str = "") -> Iterator[S3]:
    """Start moto's S3 server on a free loopback port, make a new bucket (``bucket``, default a fresh name: moto's
    state is per process, shared by every server it starts), stop it after."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request otherwise
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    saved = {k: os.environ.get(k) for k in KEYS}
    os.environ.update(KEYS)  # botocore in this process signs with them (moto checks nothing but their presence)
    server.start()
    try:
        s3 = S3(f"http://127.0.0.1:{port}", bucket or f"rr-rollouts-{uuid.uuid4().hex[:12]}")
        s3.filesystem().mkdir(s3.bucket)
        yield s3
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
