"""Fixtures of the s3 tier tests: one real S3 server (moto) for the session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from s3_helpers import BUCKET, MotoS3


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[MotoS3]:
    """moto's S3 server on 127.0.0.1 and a free port, with the test bucket."""
    server = MotoS3()
    server.start()
    server.client().create_bucket(Bucket=BUCKET)
    yield server
    server.stop()


@pytest.fixture
def s3_client(moto_s3: MotoS3):
    """A boto3 client of the test server, to look at and tamper with objects."""
    return moto_s3.client()
