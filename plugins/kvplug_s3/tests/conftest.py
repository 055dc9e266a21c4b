"""Fixtures of the s3 tier tests: real S3 servers for the session, moto's and
SeaweedFS's S3 gateway, both on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvplug_s3.testing import BUCKET, MotoS3, SeaweedS3


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[MotoS3]:
    """moto's S3 server on 127.0.0.1 and a free port, with the test bucket."""
    server = MotoS3()
    server.start()
    server.client().create_bucket(Bucket=BUCKET)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def seaweed_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    """SeaweedFS (master, volume, filer, S3 gateway) on 127.0.0.1, with the test bucket;
    it checks request signatures against one identity (kvplug_s3.testing's keys)."""
    server = SeaweedS3(tmp_path_factory.mktemp("seaweedfs"))
    server.start()
    yield server
    server.close()


@pytest.fixture(params=["moto", "seaweedfs"])
def s3_server(request: pytest.FixtureRequest) -> MotoS3 | SeaweedS3:
    """Each real S3 server in turn."""
    return request.getfixturevalue("moto_s3" if request.param == "moto" else "seaweed_s3")


@pytest.fixture
def s3_client(moto_s3: MotoS3):
    """A boto3 client of the test server, to look at and tamper with objects."""
    return moto_s3.client()
