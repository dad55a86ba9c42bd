"""Smoke tests of the real test services the rest of the suite relies on (tests/conftest.py)."""
from __future__ import annotations

import hashlib
import io
import os
import re
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.services

MiB = 1024 * 1024


def _run(argv, **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False, **kwargs)


# --------------------------------------------------------------------------- S3 (SeaweedFS)


def test_s3_multipart_round_trip(s3_server, s3_bucket):
    from boto3.s3.transfer import TransferConfig

    client = s3_server.client()
    payload = os.urandom(20 * MiB + 12345)  # not a multiple of the part size
    config = TransferConfig(multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB, max_concurrency=4)
    client.upload_fileobj(io.BytesIO(payload), s3_bucket, "ckpt/blob.bin", Config=config)

    head = client.head_object(Bucket=s3_bucket, Key="ckpt/blob.bin")
    assert head["ContentLength"] == len(payload)
    # A multipart upload's ETag is "<md5 of part md5s>-<number of parts>".
    assert head["ETag"].strip('"').endswith("-5"), head["ETag"]

    out = io.BytesIO()
    client.download_fileobj(s3_bucket, "ckpt/blob.bin", out, Config=config)
    assert hashlib.sha256(out.getvalue()).digest() == hashlib.sha256(payload).digest()

    listed = client.list_objects_v2(Bucket=s3_bucket, Prefix="ckpt/")
    assert [o["Key"] for o in listed["Contents"]] == ["ckpt/blob.bin"]


def test_s3_bucket_is_fresh_and_unique(s3_server, s3_bucket):
    client = s3_server.client()
    assert client.list_objects_v2(Bucket=s3_bucket).get("KeyCount", 0) == 0
    assert s3_bucket in [b["Name"] for b in client.list_buckets()["Buckets"]]


def test_s3_wrong_secret_is_rejected(s3_server, s3_bucket):
    from botocore.exceptions import ClientError

    bad = s3_server.client(secret_key="not-the-secret", max_attempts=1)
    with pytest.raises(ClientError) as err:
        bad.put_object(Bucket=s3_bucket, Key="x", Body=b"should not land")
    assert err.value.response["Error"]["Code"] in {
        "SignatureDoesNotMatch", "InvalidAccessKeyId", "AccessDenied"}, err.value.response
    with pytest.raises(ClientError) as err:
        bad.list_buckets()
    assert err.value.response["Error"]["Code"] in {
        "SignatureDoesNotMatch", "InvalidAccessKeyId", "AccessDenied"}, err.value.response

    unknown = s3_server.client(access_key="NOSUCHKEY", max_attempts=1)
    with pytest.raises(ClientError) as err:
        unknown.get_object(Bucket=s3_bucket, Key="x")
    assert err.value.response["Error"]["Code"] in {"InvalidAccessKeyId", "AccessDenied"}, err.value.response

    # Nothing was written by the rejected clients.
    assert s3_server.client().list_objects_v2(Bucket=s3_bucket).get("KeyCount", 0) == 0


def test_s3_data_survives_stop_and_start(s3_server, s3_bucket):
    from botocore.exceptions import BotoCoreError, ClientError

    client = s3_server.client()
    payload = os.urandom(3 * MiB)
    client.put_object(Bucket=s3_bucket, Key="state/step-1", Body=payload)
    endpoint, pid_before = s3_server.endpoint_url, s3_server.pid

    s3_server.stop()
    assert not s3_server.running
    with pytest.raises((BotoCoreError, ClientError)):
        s3_server.client(max_attempts=1, connect_timeout=1).list_buckets()

    t0 = time.monotonic()
    s3_server.start()
    restart_s = time.monotonic() - t0
    assert s3_server.running and s3_server.pid != pid_before
    assert s3_server.endpoint_url == endpoint  # same ports, same data dir
    assert client.get_object(Bucket=s3_bucket, Key="state/step-1")["Body"].read() == payload
    client.put_object(Bucket=s3_bucket, Key="state/step-2", Body=b"after restart")
    assert restart_s < 30


def test_s3_background_outage(s3_server, s3_bucket):
    client = s3_server.client(max_attempts=1, connect_timeout=1)
    client.put_object(Bucket=s3_bucket, Key="k", Body=b"v")
    outage = s3_server.outage(duration=2.0)
    deadline = time.monotonic() + 10
    while s3_server.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not s3_server.running, "the outage never stopped the server"
    outage.join(60)
    assert not outage.is_alive() and outage.error is None, outage.error
    assert s3_server.running
    assert client.get_object(Bucket=s3_bucket, Key="k")["Body"].read() == b"v"


def test_s3_env_for_subprocesses(s3_server, s3_bucket):
    s3_server.client().put_object(Bucket=s3_bucket, Key="from-parent", Body=b"hello")
    code = (
        "import boto3, sys; from botocore.config import Config;"
        "c = boto3.client('s3', config=Config(s3={'addressing_style': 'path'}));"
        f"sys.stdout.write(c.get_object(Bucket='{s3_bucket}', Key='from-parent')['Body'].read().decode())"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(s3_server.env())
    out = _run([sys.executable, "-c", code], env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "hello"


# --------------------------------------------------------------------------- Prometheus


@pytest.fixture
def exporter(free_port):
    """A tiny exporter on a free port: gauge rljob_smoke_value = 42, with a `job` label."""
    from prometheus_client import CollectorRegistry, Gauge, start_http_server

    registry = CollectorRegistry()
    gauge = Gauge("rljob_smoke_value", "smoke test gauge", ["job"], registry=registry)
    gauge.labels(job="trainer").set(42)
    port = free_port()
    server, _thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    yield f"127.0.0.1:{port}"
    server.shutdown()
    server.server_close()


def test_prometheus_scrapes_exporter(prometheus_server, exporter):
    prom = prometheus_server([exporter])
    result = prom.wait_for("rljob_smoke_value", timeout=30)
    assert float(result[0]["value"][1]) == 42.0
    labels = result[0]["metric"]
    # The scraped `job` label is renamed; `job` is the scrape job's.
    assert labels["exported_job"] == "trainer" and labels["job"] == "rljob", labels
    assert labels["instance"] == exporter
    assert prom.value('sum(rljob_smoke_value{exported_job="trainer"})') == 42.0
    assert prom.query("rljob_no_such_metric") == []
    assert [t["health"] for t in prom.targets()] == ["up"]


def test_prometheus_query_error_is_raised(prometheus_server):
    prom = prometheus_server([])
    with pytest.raises(RuntimeError, match="bad_data") as err:
        prom.query("sum(")
    assert type(err.value).__name__ == "PrometheusQueryError"
    assert prom.value("1 + 1") == 2.0  # a scalar result


def test_prometheus_rules_and_alerts(prometheus_server, exporter, tmp_path):
    rules = tmp_path / "rules.yml"
    rules.write_text(
        "groups:\n"
        "- name: smoke\n"
        "  rules:\n"
        "  - record: rljob:smoke_value:doubled\n"
        "    expr: rljob_smoke_value * 2\n"
        "  - alert: SmokeValueHigh\n"
        "    expr: rljob_smoke_value > 40\n"
    )
    prom = prometheus_server([exporter], [rules])
    assert float(prom.wait_for("rljob:smoke_value:doubled")[0]["value"][1]) == 84.0
    firing = prom.wait_for('ALERTS{alertname="SmokeValueHigh", alertstate="firing"}')
    assert firing[0]["metric"]["alertname"] == "SmokeValueHigh"


def test_promtool_accepts_generated_config(prometheus_server, promtool_bin, exporter, tmp_path):
    rules = tmp_path / "rules.yml"
    rules.write_text("groups:\n- name: g\n  rules:\n  - record: a:b\n    expr: up\n")
    prom = prometheus_server([exporter], [rules])
    out = _run([promtool_bin, "check", "config", str(prom.config_path)])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout + out.stderr
    prom.stop()
    assert not prom.running

    broken = tmp_path / "broken.yml"
    broken.write_text("groups:\n- name: g\n  rules:\n  - record: a:b\n    expr: sum(\n")
    out = _run([promtool_bin, "check", "rules", str(broken)])
    assert out.returncode != 0


# --------------------------------------------------------------------------- helm, kubectl


def test_helm_version(helm_bin):
    out = _run([helm_bin, "version", "--short"])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith("v4.3.1"), out.stdout


def test_kubectl_version(kubectl_bin):
    out = _run([kubectl_bin, "version", "--client"])
    assert out.returncode == 0, out.stderr
    assert "Client Version: v1.37.1" in out.stdout, out.stdout


def test_weed_binary(weed_bin):
    out = _run([weed_bin, "version"])
    assert out.returncode == 0, out.stderr
    assert re.search(r"version .*\b\d+\.\d+\b", out.stdout + out.stderr), out.stdout + out.stderr
