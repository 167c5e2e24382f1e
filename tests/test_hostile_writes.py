"""Nothing a client writes into Redis doubles, poisons or stops anything (#28 item 7): forged
timing fits and memory peaks, a job's data nested past the JSON reader's stack or inflating to
300 MB, input images that are 16-bit or made of 200,000 chunks, and replayed images whose details
break a request's rules or nest 50,000 deep. One real `kiln worker --metrics-port` process serves
every test here, over real Redis (forged memory peaks: tests/test_hostile_peaks.py)."""

from __future__ import annotations

import hashlib
import io
import json
import struct
import time
import urllib.request
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy
import pytest
from PIL import Image
from PIL.PngImagePlugin import PngInfo
from redis import Redis

from api_client import RenderFailed, RequestRejected, keys
from api_client.inputs import MAX_PNG_CHUNKS
from api_client.keys import input_key
from api_client.manifest import load_manifest_dir
from api_client.schema import RENDER_FUNC, TimingFit
from api_client.webhooks import MAX_DATA_BYTES, job_webhook_target
from tests.conftest import MANIFESTS, kiln
from tests.support.deployments import Deployment, alive, deployed, ends, prepared, quarantined
from tests.support.images import tiny_details
from tests.support.records import log_lines, render_record
from tests.workers import free_port, wait_until
from worker.files.details import DETAILS_KEY, MAX_DEPTH
from worker.queue.upkeep.backlog import default_request
from worker.render.inputs import open_input

MODEL = "tiny-sd15"
UNSERVED = "tiny-sdxl"  # a model with a manifest and no worker: its jobs stay queued
QUEUE_KEY = f"rq:queue:{keys.queue_name(MODEL)}"
GOOD: dict[str, Any] = {"model": MODEL, "prompt": "ok", "steps": 2, "seed": 1}
MB = 1024 * 1024
BAD_FITS = {  # kiln:fits field -> value, written before the worker starts
    keys.fit_field(MODEL, 128, 128): b"not json",
    f"{MODEL}:bogus": TimingFit(fixed_s=1, per_step_s=1, samples=1).model_dump_json().encode(),
    keys.fit_field(MODEL, 192, 128): b'{"fixed_s": "soon", "per_step_s": 1, "samples": 1}',
}


@pytest.fixture(scope="module")
def deployment(
    redis_url: str, tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    out = tmp_path_factory.mktemp("hostile-writes")
    conn, env = prepared(redis_url, tiny_dir, out)
    conn.hset(keys.FITS_KEY, mapping=BAD_FITS)
    port = free_port()
    args = ("--models", MODEL, "--metrics-port", str(port))
    with deployed(conn, env, out / "worker.log", *args, metrics_port=port) as d:
        yield d


def record_with_data(conn: Redis, data: bytes) -> str:
    """A queued rq record for kiln's render call whose data field is then replaced by these
    bytes, its id pushed on the model's queue: what a producer with Redis access can write."""
    job = render_record(conn, MODEL, GOOD)
    conn.hset(job.key, "data", data)
    conn.rpush(QUEUE_KEY, job.id)
    return str(job.id)


def done_records(d: Deployment, job_id: str) -> int:
    return len(log_lines(d.timings_log, job_id))


def records_after_its_end(d: Deployment, job_id: str) -> int:
    """The job's timing records once its first is written: the worker publishes the record after
    it commits the end in Redis (the `finish` crash point lies between), so a client that saw the
    end can be ahead of the log."""
    wait_until(lambda: done_records(d, job_id) > 0, 30, f"job {job_id}'s timing record")
    return done_records(d, job_id)


def memory_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for pid {pid}")


# -- kiln:fits ----------------------------------------------------------------------------------


def test_unreadable_fits_are_skipped_by_every_reader(deployment: Deployment) -> None:
    """The worker started with --metrics-port (it exited 2 with `KILN_=b'not json'` before);
    /metrics, `kiln models`, `kiln top`, client.models() and job.eta() all read past the fields
    and still use the good fit; each bad field is logged once, naming the key and the field."""
    d = deployment
    alive(d)
    d.conn.hset(keys.FITS_KEY, mapping=BAD_FITS)  # again: the worker may have measured one since
    manifest = load_manifest_dir(MANIFESTS)[0][UNSERVED]
    size = default_request(manifest)
    good = TimingFit(fixed_s=2.0, per_step_s=0.5, samples=3)
    d.conn.hset(
        keys.FITS_KEY,
        keys.fit_field(UNSERVED, size["width"], size["height"]),
        good.model_dump_json(),
    )
    for _ in range(3):
        url = f"http://127.0.0.1:{d.metrics_port}/metrics"
        scraped = urllib.request.urlopen(url, timeout=10).read().decode()
        assert f'kiln_queue_depth{{model="{MODEL}"}}' in scraped
    models = kiln("models", "--json", env=d.env, timeout=60)
    assert models.returncode == 0, models.stderr
    assert "KILN_" not in models.stderr
    assert {m["id"] for m in json.loads(models.stdout)} >= {MODEL, UNSERVED}
    top = kiln("top", "--once", env=d.env, timeout=60)
    assert top.returncode == 0, top.stderr
    info = {m.manifest.id: m for m in d.client.models()}
    assert info[UNSERVED].fits == {(size["width"], size["height"]): good}
    assert (192, 128) not in info[MODEL].fits  # never rendered here: its field stays unreadable
    queued = d.client.submit({"model": UNSERVED, "prompt": "waits", "steps": 4})
    assert queued.eta() == pytest.approx(good.eta(4))
    assert ends(d, d.client.submit(GOOD)).images
    alive(d)
    log = d.worker.output()
    for name in BAD_FITS:
        assert log.count(f"kiln:fits field {name!r} is not a timing fit") == 1, (name, log)


# -- a job's data --------------------------------------------------------------------------------


def test_data_nested_past_the_json_readers_stack_is_quarantined(deployment: Deployment) -> None:
    """1,500 nested arrays killed the worker (exit 1) through the quarantine's webhook read, and
    the job was lost; now it is quarantined with its reason, and the next job runs."""
    d = deployment
    depth = 1500
    nested = "[" * depth + "]" * depth
    request = {**GOOD, "webhook": "hooks"}
    payload = json.dumps([RENDER_FUNC, None, [], {"request": request}])
    data = payload[:-2] + f', "deep": {nested}}}]'
    assert job_webhook_target(data.encode()) is None  # read as unreadable, never raised
    bad = record_with_data(d.conn, zlib.compress(data.encode()))
    assert ends(d, d.client.submit(GOOD)).images
    alive(d)
    reason = quarantined(d, bad)["reason"]
    assert "data: JSON nested too deep to read" in reason, reason
    with pytest.raises(RenderFailed, match="quarantined: data: JSON nested too deep"):
        d.client.job(bad).wait(timeout=1)
    assert done_records(d, bad) == 0


def test_a_zlib_bomb_in_data_is_refused_at_its_bound(deployment: Deployment) -> None:
    """306 KB of zlib that inflates to 300 MB: the worker stops at MAX_DATA_BYTES (16 MiB) and
    quarantines the record naming `data` and the bound; its peak memory barely moves."""
    d = deployment
    deflater = zlib.compressobj(9)
    payload = json.dumps([RENDER_FUNC, None, [], {"request": GOOD}]).encode()
    parts = [deflater.compress(payload)]
    spaces = b" " * MB
    parts += [deflater.compress(spaces) for _ in range(300)]  # JSON's own whitespace
    bomb = b"".join([*parts, deflater.flush()])
    assert len(bomb) < 400_000
    assert ends(d, d.client.submit(GOOD)).images  # warm: what a job takes is in the peak
    pid = d.worker.proc.pid
    peak_before, rss_before = memory_kb(pid, "VmHWM"), memory_kb(pid, "VmRSS")
    bad = record_with_data(d.conn, bomb)
    assert ends(d, d.client.submit(GOOD)).images
    alive(d)
    peak_after, rss_after = memory_kb(pid, "VmHWM"), memory_kb(pid, "VmRSS")
    print(
        f"\nbomb {len(bomb)} bytes: worker peak {peak_before // 1024} -> {peak_after // 1024} MB,"
        f" resident {rss_before // 1024} -> {rss_after // 1024} MB"
    )
    assert peak_after - peak_before < 120 * 1024, (peak_before, peak_after)
    reason = quarantined(d, bad)["reason"]
    assert f"data: inflates past {MAX_DATA_BYTES // MB} MiB (MAX_DATA_BYTES)" in reason, reason
    assert done_records(d, bad) == 0


# -- input images --------------------------------------------------------------------------------


def _chunk(kind: bytes, body: bytes) -> bytes:
    crc = zlib.crc32(kind + body) & 0xFFFFFFFF
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)


def chunk_bomb(chunks: int) -> bytes:
    """A valid 128x128 RGB PNG with this many tiny tEXt chunks before its pixels."""
    header = struct.pack(">IIBBBBB", 128, 128, 8, 2, 0, 0, 0)
    pixels = zlib.compress(b"".join(b"\x00" + bytes(128 * 3) for _ in range(128)))
    text = _chunk(b"tEXt", b"k\x00v") * chunks
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", header)
        + text
        + _chunk(b"IDAT", pixels)
        + _chunk(b"IEND", b"")
    )


def grey16_png() -> bytes:
    """A 128x128 16-bit grey ramp, 0 to 65535: half its pixels are above mid-grey."""
    ramp = numpy.linspace(0, 65535, 128 * 128).reshape(128, 128).astype(numpy.uint16)
    buffer = io.BytesIO()
    Image.fromarray(ramp).save(buffer, format="PNG")
    return buffer.getvalue()


def test_a_16_bit_grey_png_renders_scaled_not_clipped(deployment: Deployment) -> None:
    d = deployment
    data = grey16_png()
    assert Image.open(io.BytesIO(data)).mode == "I;16"
    opened = numpy.asarray(open_input(data, "kiln-input:x"))
    assert (opened == 255).mean() < 0.01 and 120 < opened.mean() < 135  # was 99.6 % white
    mask = numpy.asarray(open_input(data, "kiln-input:x", field="mask"))
    assert 120 < mask.mean() < 135
    uri = d.client.upload(data)
    job = d.client.submit({**GOOD, "image": uri, "strength": 0.5})
    assert ends(d, job).images
    assert records_after_its_end(d, job.id) == 1
    alive(d)


def test_a_png_of_200000_chunks_is_refused_before_decoding(deployment: Deployment) -> None:
    """It cost 4 s of CPU per decode (23 s at the 16 MB cap); refused now after a walk of at
    most MAX_PNG_CHUNKS length fields, naming the field and the bound, by client and worker."""
    d = deployment
    bomb = chunk_bomb(200_000)
    with pytest.raises(RequestRejected, match=f"image=.*more than {MAX_PNG_CHUNKS} PNG chunks"):
        d.client.upload(bomb)
    digest = hashlib.sha256(bomb).hexdigest()
    d.conn.set(input_key(digest), bomb, ex=600)  # as a producer writing Redis itself would
    job = d.client.job(_enqueue(d, {**GOOD, "image": f"kiln-input:{digest}", "strength": 0.5}))
    started = time.monotonic()
    with pytest.raises(RenderFailed, match=r"image kiln-input:.*MAX_PNG_CHUNKS") as caught:
        ends(d, job)
    print(f"\nchunk bomb refused {time.monotonic() - started:.2f} s after it was queued")
    assert "more than 10000 PNG chunks" in caught.value.message
    assert records_after_its_end(d, job.id) == 1  # one record: the job ended once, as failed
    alive(d)
    assert chunk_bomb(MAX_PNG_CHUNKS - 4)  # at the bound: still an image (test_inputs decodes)
    assert open_input(chunk_bomb(MAX_PNG_CHUNKS - 4), "kiln-input:x").size == (128, 128)


def _enqueue(d: Deployment, request: dict[str, Any]) -> str:
    from tests.support.records import enqueue_raw

    return enqueue_raw(d.conn, MODEL, {"request": request})


# -- kiln replay ---------------------------------------------------------------------------------


def image_with_details(path: Path, document: str) -> Path:
    info = PngInfo()
    info.add_itxt(DETAILS_KEY, document)
    Image.new("RGB", (128, 128)).save(path, format="PNG", pnginfo=info)
    return path


def test_replay_of_five_loras_names_the_request_field_and_its_bound(
    deployment: Deployment, tmp_path: Path
) -> None:
    d = deployment
    loras = [{"name": f"lora{i}", "weight": 0.5} for i in range(5)]
    data = tiny_details("png").model_dump(mode="json")
    data["loras"] = loras
    image = image_with_details(tmp_path / "five.png", json.dumps(data))
    done = kiln("replay", str(image), env=d.env, timeout=60)
    assert done.returncode == 2
    assert "KILN_" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(f"kiln replay: {image}: its kiln details are invalid: loras=")
    assert "at most 4 items" in line, line
    assert d.conn.llen(QUEUE_KEY) == 0  # nothing enqueued


def test_replay_of_details_nested_50000_deep_is_one_line(
    deployment: Deployment, tmp_path: Path
) -> None:
    d = deployment
    data = tiny_details("png").model_dump(mode="json")
    document = json.dumps(data)[:-1] + ', "deep": ' + "[" * 50_000 + "]" * 50_000 + "}"
    image = image_with_details(tmp_path / "deep.png", document)
    done = kiln("replay", str(image), env=d.env, timeout=60)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and "RecursionError" not in done.stderr, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line == (  # 50,001: the details object, then its 50,000 arrays
        f"kiln replay: {image}: its kiln details (the 'kiln' chunk) nest 50001 levels deep;"
        f" kiln's nest at most {MAX_DEPTH}"
    ), line


# -- whose error it is ---------------------------------------------------------------------------


def test_only_a_settings_error_is_blamed_on_a_kiln_variable(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`KILN_=b'not json'` came from main() reading every pydantic error as a setting's: a value
    read from Redis is named by its model and field, a setting by its variable."""
    from pydantic import ValidationError

    from worker.cli import _print_invalid
    from worker.settings import Settings

    with pytest.raises(ValidationError) as fit_error:
        TimingFit.model_validate_json(b"not json")
    with pytest.raises(ValidationError) as setting_error:
        Settings(metrics_port="a port")  # type: ignore[arg-type]
    _print_invalid("models", fit_error.value)
    _print_invalid("worker", setting_error.value)
    fit_line, setting_line = capsys.readouterr().err.splitlines()
    assert fit_line.startswith("kiln models: TimingFit field value=b'not json': Invalid JSON")
    assert setting_line.startswith("kiln worker: KILN_METRICS_PORT='a port': ")
