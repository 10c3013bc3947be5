"""Fixtures of the routing store tests: a local Ray cluster (tests/ray's) and an S3-protocol server on loopback."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.ray.conftest import ray_cluster  # noqa: F401 - the same fixture, for the Ray backend
from tests.support.s3_server import S3, s3_server


@pytest.fixture(scope="module")
def s3() -> Iterator[S3]:
    """moto's S3 server on a loopback port with one bucket, for the module."""
    with s3_server() as server:
        yield server
