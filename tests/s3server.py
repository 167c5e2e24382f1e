"""A real S3-compatible HTTP server for tests: moto's standalone server in its own process on
127.0.0.1, driven only over HTTP (nothing of boto3 or moto is patched in the test process).

With auth=True moto checks credentials (INITIAL_NO_AUTH_ACTION_COUNT: the first few actions,
which create the IAM user, its key and the bucket, go unchecked; every later one is checked).
moto cannot serve presigned GETs in that mode (it answers 500), so tests that fetch through
presigned URLs use a server without auth.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.workers import free_port, wait_until

BUCKET = "kiln-test"
REGION = "us-east-1"
# Unchecked actions in auth mode: create_user, put_user_policy, create_access_key, create_bucket.
SETUP_ACTIONS = 4


class MotoServer:
    def __init__(self, log: Path, auth: bool = False, port: int | None = None) -> None:
        self.log = log
        self.auth = auth
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.access_key = "test-access-key"
        self.secret_key = "test-secret-key-not-checked"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        if self.auth:
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = str(SETUP_ACTIONS)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        wait_until(self._up, 30, f"moto server on port {self.port}", poll=0.1)

    def _up(self) -> bool:
        import urllib.error
        import urllib.request

        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"moto server exited:\n{self.log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=1):
                return True
        except urllib.error.HTTPError:
            return True
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=20)

    def client(self, service: str = "s3", **keys: str) -> Any:
        import boto3

        return boto3.client(
            service,
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id=keys.get("access", self.access_key),
            aws_secret_access_key=keys.get("secret", self.secret_key),
        )

    def setup(self, bucket: str = BUCKET) -> None:
        """The bucket, and in auth mode an IAM user allowed s3:* whose key the tests use."""
        if self.auth:
            iam = self.client("iam")
            iam.create_user(UserName="kiln")
            policy = {
                "Version": "2012-10-17",
                "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}],
            }
            iam.put_user_policy(UserName="kiln", PolicyName="s3", PolicyDocument=json.dumps(policy))
            key = iam.create_access_key(UserName="kiln")["AccessKey"]
            self.access_key, self.secret_key = key["AccessKeyId"], key["SecretAccessKey"]
        self.client().create_bucket(Bucket=bucket)

    def keys_under(self, prefix: str, bucket: str = BUCKET) -> list[str]:
        answer = self.client().list_objects_v2(Bucket=bucket, Prefix=prefix)
        return sorted(item["Key"] for item in answer.get("Contents", []))

    def store_settings(self, bucket: str = BUCKET, prefix: str = "renders") -> dict[str, Any]:
        """make_settings overrides for a worker whose store is this server."""
        return {
            "output_url": f"s3://{bucket}/{prefix}",
            "aws_endpoint_url": self.endpoint,
            "aws_region": REGION,
            "aws_access_key_id": self.access_key,
            "aws_secret_access_key": self.secret_key,
        }
