"""Video files (worker/files/video.py) read back as written: size, frame count, frame rate and
duration from the bytes, the details JSON byte for byte, each frame's colour, MP4 as H.264 with
moov before mdat, WebM as VP9, WebP animated; bad input is refused naming the field."""

from __future__ import annotations

import io
import json
import struct
import subprocess
import sys
from itertools import product

import av
import pytest
from PIL import Image, ImageStat

from worker.files import video
from worker.files.video import VIDEO_FORMATS, VideoFormat

# Far apart in every channel order, so a frame read from the wrong place cannot pass for another.
COLOURS = [((i * 53) % 256, (i * 97 + 40) % 256, (200 - i * 71) % 256) for i in range(17)]
TOLERANCE = 6  # levels per channel: yuv420p and lossy coding of a flat colour stay well inside
EMOJI_PROMPT = "🦊🌲" * 2000  # 4000 characters, 4 UTF-8 bytes each
DETAILS = json.dumps(
    {"details_version": 1, "prompt": EMOJI_PROMPT, "negative_prompt": 'trübe, 模糊\n"x"'},
    ensure_ascii=False,
)


def flat_frames(count: int, width: int, height: int) -> list[Image.Image]:
    return [Image.new("RGB", (width, height), COLOURS[i]) for i in range(count)]


def mean_colour(image: Image.Image) -> tuple[float, ...]:
    return tuple(ImageStat.Stat(image.convert("RGB")).mean)


def top_level_boxes(data: bytes) -> list[str]:
    """The MP4's top-level box types in file order (ISO 14496-12: 32-bit size, 4-char type;
    size 1: a 64-bit size follows; size 0: to the end of the file)."""
    boxes, offset = [], 0
    while offset + 8 <= len(data):
        size, kind = struct.unpack(">I4s", data[offset : offset + 8])
        if size == 1:
            (size,) = struct.unpack(">Q", data[offset + 8 : offset + 16])
        boxes.append(kind.decode("latin-1"))
        if size == 0:
            break
        offset += size
    return boxes


ROUND_TRIPS = list(product(VIDEO_FORMATS, [(64, 64), (96, 64)], [9, 17], [8, 16]))


@pytest.mark.parametrize(("fmt", "size", "count", "fps"), ROUND_TRIPS)
def test_a_video_reads_back_as_written(
    fmt: VideoFormat, size: tuple[int, int], count: int, fps: int
) -> None:
    frames = flat_frames(count, *size)
    data = video.encode(frames, fps, fmt, DETAILS)

    info = video.probe(data)
    assert (info.format, info.width, info.height, info.frames) == (fmt, *size, count)
    # WebP keeps whole milliseconds a frame: its rate is the rendered one to within 1 %.
    assert info.fps == (fps if fmt != "webp" else pytest.approx(fps, rel=0.01))
    assert abs(info.duration_s - count / fps) < 1 / fps
    assert video.read_details(data) == DETAILS
    for index in (0, 1, count - 1):
        decoded = video.frame(data, index)
        assert decoded.size == size
        got, want = mean_colour(decoded), COLOURS[index]
        assert all(abs(g - w) <= TOLERANCE for g, w in zip(got, want, strict=True)), (index, got)


def test_mp4_is_h264_yuv420p_tagged_bt709_with_moov_before_mdat() -> None:
    data = video.encode(flat_frames(9, 96, 64), 8, "mp4", DETAILS)
    boxes = top_level_boxes(data)
    assert boxes.index("moov") < boxes.index("mdat"), boxes  # a browser plays before the end
    with av.open(io.BytesIO(data)) as container:
        context = container.streams.video[0].codec_context
        assert (context.name, context.pix_fmt) == ("h264", "yuv420p")
        assert (context.colorspace, context.color_range) == (1, 1)  # BT.709, limited range


def test_webm_is_vp9_yuv420p() -> None:
    data = video.encode(flat_frames(9, 64, 64), 8, "webm", None)
    assert data[:4] == b"\x1a\x45\xdf\xa3"  # EBML
    with av.open(io.BytesIO(data)) as container:
        assert container.format.name == "matroska,webm"
        context = container.streams.video[0].codec_context
        assert (context.name, context.pix_fmt) == ("vp9", "yuv420p")


def test_webp_is_animated_and_loops() -> None:
    data = video.encode(flat_frames(17, 96, 64), 16, "webp", DETAILS)
    with Image.open(io.BytesIO(data)) as image:
        assert image.format == "WEBP"
        assert getattr(image, "is_animated", False)
        assert getattr(image, "n_frames", 1) == 17
        assert image.info["loop"] == 0  # forever


@pytest.mark.parametrize("fmt", VIDEO_FORMATS)
def test_the_longest_details_and_none(fmt: VideoFormat) -> None:
    longest = json.dumps({"prompt": EMOJI_PROMPT, "negative_prompt": EMOJI_PROMPT})
    frames = flat_frames(9, 64, 64)
    assert video.read_details(video.encode(frames, 8, fmt, longest)) == longest
    assert video.read_details(video.encode(frames, 8, fmt, None)) is None


def test_webp_merges_a_repeated_frame_and_keeps_the_clip_s_length() -> None:
    """libwebp folds a frame no different from the one before into it (the module docstring)."""
    frames = [Image.new("RGB", (64, 64), colour) for colour in (COLOURS[0], COLOURS[0], COLOURS[1])]
    info = video.probe(video.encode(frames, 8, "webp", None))
    assert (info.frames, info.duration_s) == (2, 3 / 8)
    mp4 = video.probe(video.encode(frames, 8, "mp4", None))
    assert mp4.frames == 3


@pytest.mark.parametrize("fmt", ["webm", "webp"])
def test_the_same_frames_give_the_same_bytes(fmt: VideoFormat) -> None:
    """Matroska's segment and track UIDs are random unless FFmpeg writes bitexact. (MP4 is not
    byte-stable: the module docstring says why.)"""
    frames = flat_frames(9, 96, 64)
    assert video.encode(frames, 8, fmt, DETAILS) == video.encode(frames, 8, fmt, DETAILS)


def test_formats_name_their_content_type_and_suffix() -> None:
    assert {fmt: (row.content_type, row.suffix) for fmt, row in video.FORMATS.items()} == {
        "mp4": ("video/mp4", ".mp4"),
        "webm": ("video/webm", ".webm"),
        "webp": ("image/webp", ".webp"),
    }


BAD_INPUTS = [
    ([], 8, "mp4", r"frames: none given"),
    (flat_frames(2, 64, 64) + flat_frames(1, 64, 48), 8, "mp4", r"frame 2 is 64x48, frame 0 64x64"),
    (flat_frames(3, 63, 64), 8, "mp4", r"frame size 63x64 is odd"),
    (flat_frames(3, 64, 30 + 1), 8, "webp", r"frame size 64x31 is odd"),
    (flat_frames(3, 64, 64), 0, "mp4", r"fps 0 is out of range"),
    (flat_frames(3, 64, 64), -8, "webm", r"fps -8 is out of range"),
    (flat_frames(3, 64, 64), 121, "webp", r"fps 121 is out of range; .* 1 to 120"),
    (flat_frames(3, 64, 64), 8, "gif", r"format 'gif' is not a video format"),
]


@pytest.mark.parametrize(("frames", "fps", "fmt", "message"), BAD_INPUTS)
def test_bad_input_is_refused_naming_the_field(
    frames: list[Image.Image], fps: int, fmt: VideoFormat, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        video.encode(frames, fps, fmt, None)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", r"empty \(0 bytes\)"),
        (b"not a video at all" * 10, r"not a video kiln can read"),
        (b"RIFF\x40\x00\x00\x00WEBPVP8 " + b"\x00" * 60, r"not a WebP kiln can read"),
    ],
)
def test_bytes_that_are_no_video_are_refused(data: bytes, message: str) -> None:
    for read in (video.probe, video.read_details, video.frame):
        with pytest.raises(ValueError, match=message):
            read(data)


@pytest.mark.parametrize("fmt", VIDEO_FORMATS)
def test_a_frame_past_the_end_is_refused(fmt: VideoFormat) -> None:
    data = video.encode(flat_frames(9, 64, 64), 8, fmt, None)
    with pytest.raises(ValueError, match=r"frame index 9 is past the video's 9 frames"):
        video.frame(data, 9)
    with pytest.raises(ValueError, match=r"frame index -1 is negative"):
        video.frame(data, -1)


def test_importing_the_module_loads_no_ffmpeg() -> None:
    code = "import sys, worker.files.video; assert 'av' not in sys.modules, 'av imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
