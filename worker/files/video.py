"""Video files kiln writes, and reading them back: MP4 (H.264), WebM (VP9) and animated WebP,
each carrying the job's generation details (the JSON worker/files/details.py writes into images).
PyAV (FFmpeg's libraries in its wheels) encodes MP4 and WebM, Pillow the WebP; av is imported
inside the functions that use it, so importing this module loads no FFmpeg.

Where the details go, under kiln's key (tags.DETAILS_KEY, "kiln"):
- MP4: a metadata tag in moov's udta (movflags use_metadata_tags: FFmpeg writes custom keys only
  then, and drops them silently otherwise).
- WebM: a Matroska SimpleTag (FFmpeg's reader gives it back as "KILN": tag names are upper case).
- WebP: EXIF UserComment (UNICODE, UTF-16 in the EXIF block's byte order), as for a still WebP.

An animated WebP's frames are whatever libwebp kept: it merges a frame into the one before when
no pixel differs by more than its lossy tolerance (3 levels at quality 90), adding the
durations; when all frames merge the file is a still WebP with no frame rate. So a near-static
clip's WebP can probe fewer frames than were rendered (MP4 and WebM keep every frame).

The same frames give the same WebM and WebP bytes. Not the same MP4 bytes: libx264 as PyAV 18.1
ships it reads memory it did not write when a frame's width is not a multiple of 64 (measured:
identical frames, one encoder thread, a different file on every run once the heap has been
churned; 512 wide stays the same), so two files of one clip differ by under 1 % in size and
not in frame count or quality (PSNR to the frames the same to 0.1 dB).
"""

from __future__ import annotations

import contextlib
import io
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, get_args

from PIL import Image

from worker.files.tags import DETAILS_KEY, details_from_exif, exif_with_details

if TYPE_CHECKING:
    import av.container

VideoFormat = Literal["mp4", "webm", "webp"]
FfmpegCodec = Literal["libx264", "libvpx-vp9"]
VIDEO_FORMATS: tuple[VideoFormat, ...] = get_args(VideoFormat)
MAX_FPS = 120
_WEBP_QUALITY = 90
_WEBP_MAGIC = (b"RIFF", b"WEBP")  # bytes 0-4 and 8-12 of every WebP file


@dataclass(frozen=True)
class Container:
    """One video format kiln writes: what it is on the wire and how FFmpeg makes it."""

    content_type: str
    suffix: str
    codec: FfmpegCodec | None  # None: Pillow writes it (WebP)
    # The encoder's options, for short generated clips: near-transparent quality at a cost
    # small beside the render (measured on 33 frames of 480x832 on 2 busy cores).
    codec_options: dict[str, str] = field(default_factory=dict)
    muxer_options: dict[str, str] = field(default_factory=dict)


FORMATS: dict[VideoFormat, Container] = {
    "mp4": Container(
        "video/mp4",
        ".mp4",
        "libx264",
        # medium: the size of veryfast at 0.5 dB more, for 0.8 s of CPU against 0.4 (and
        # smaller than fast and faster, which spend more bits on the same picture).
        {"crf": "18", "preset": "medium"},
        # faststart: moov before mdat, so a browser plays before the whole file has arrived.
        # bitexact: no version strings, so the same frames give the same bytes.
        {"movflags": "+faststart+use_metadata_tags", "fflags": "+bitexact"},
    ),
    "webm": Container(
        "video/webm",
        ".webm",
        "libvpx-vp9",
        # Constant quality (crf with a zero bit rate); row-mt threads within a frame. "good" at
        # cpu-used 5: half the bytes of "realtime" at the same PSNR, 0.8 s of CPU against 0.3;
        # cpu-used 4 spent as long for 16 % more bytes.
        {"crf": "30", "b": "0", "row-mt": "1", "deadline": "good", "cpu-used": "5"},
        # bitexact: no random segment and track UIDs, so the same frames give the same bytes.
        {"fflags": "+bitexact"},
    ),
    "webp": Container("image/webp", ".webp", None),
}


@dataclass(frozen=True)
class VideoInfo:
    """What a video file says about itself, read back from its bytes."""

    width: int
    height: int
    frames: int
    fps: float  # WebP: frames kept over its length (module docstring); 0.0 for a still WebP
    format: VideoFormat
    duration_s: float


def encode(frames: Sequence[Image.Image], fps: int, fmt: VideoFormat, details: str | None) -> bytes:
    """The video file's bytes, with the details JSON inside (module docstring: where). Frames
    must share one even size: yuv420p halves the colour planes, and kiln's sizes are on a 16 px
    grid, so an odd one is a bug upstream, never padded or cropped here."""
    container = _checked(frames, fps, fmt)
    images = [image.convert("RGB") for image in frames]
    if container.codec is None:
        return _encode_webp(images, fps, details)
    return _encode_av(images, fps, container, container.codec, details)


def probe(data: bytes) -> VideoInfo:
    """Size, frame count, frame rate and duration of a video kiln wrote. MP4's count comes from
    its sample table (exact); WebM keeps none, so its frames are decoded and counted."""
    if _is_webp(data):
        return _probe_webp(data)
    with _opened(data) as container:
        fmt = _format_of(container)
        if not container.streams.video:
            raise ValueError(f"this {fmt} file holds no video stream")
        stream = container.streams.video[0]
        fps = float(stream.average_rate or stream.guessed_rate or 0)
        frames = stream.frames or sum(1 for _ in container.decode(stream))
        width, height = stream.codec_context.width, stream.codec_context.height
        duration = container.duration / 1e6 if container.duration else frames / fps
    return VideoInfo(width, height, frames, fps, fmt, duration)


def read_details(data: bytes) -> str | None:
    """The details JSON inside a video kiln wrote; None when it carries none."""
    if _is_webp(data):
        with _webp(data) as image:
            return details_from_exif(image.getexif())
    with _opened(data) as container:
        tags = {key.lower(): value for key, value in container.metadata.items()}
    return tags.get(DETAILS_KEY)


def frame(data: bytes, index: int = 0) -> Image.Image:
    """Frame `index` (from 0) of a video kiln wrote, decoded to RGB."""
    if index < 0:
        raise ValueError(f"frame index {index} is negative; frames count from 0")
    if _is_webp(data):
        with _webp(data) as image:
            count = getattr(image, "n_frames", 1)
            if index >= count:
                raise ValueError(f"frame index {index} is past the video's {count} frames")
            image.seek(index)
            return image.convert("RGB")
    with _opened(data) as container:
        count = 0
        for decoded in container.decode(video=0):
            if count == index:
                picture: Image.Image = decoded.to_image()  # type: ignore[no-untyped-call]
                return picture
            count += 1
    raise ValueError(f"frame index {index} is past the video's {count} frames")


def _checked(frames: Sequence[Image.Image], fps: int, fmt: VideoFormat) -> Container:
    """The format's row, once frames, fps and format are what a video file can hold."""
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} is not a video format; kiln writes {VIDEO_FORMATS}")
    if not 0 < fps <= MAX_FPS:
        raise ValueError(f"fps {fps} is out of range; a video's fps is 1 to {MAX_FPS}")
    if not frames:
        raise ValueError("frames: none given; a video needs at least one frame")
    width, height = frames[0].size
    for index, image in enumerate(frames):
        if image.size != (width, height):
            raise ValueError(
                f"frame {index} is {image.width}x{image.height}, frame 0 {width}x{height};"
                " every frame of a video has one size"
            )
    if width % 2 or height % 2:
        raise ValueError(
            f"frame size {width}x{height} is odd; video frames need even width and height"
            " (yuv420p halves the colour planes)"
        )
    return FORMATS[fmt]


def _encode_av(
    images: list[Image.Image],
    fps: int,
    container: Container,
    codec: FfmpegCodec,
    details: str | None,
) -> bytes:
    """MP4 or WebM through PyAV. Written to a temporary file, not to memory: faststart moves
    moov to the front by reopening the finished file by name, which a Python file object cannot
    give FFmpeg ("No such file or directory: '<none>'")."""
    import av

    with tempfile.TemporaryDirectory(prefix="kiln-video-") as tmp:
        path = Path(tmp) / f"video{container.suffix}"
        with av.open(str(path), "w", container_options=container.muxer_options) as output:
            if details is not None:
                output.metadata[DETAILS_KEY] = details
            stream = output.add_stream(codec, rate=fps, options=container.codec_options)
            stream.width, stream.height = images[0].size
            stream.pix_fmt = "yuv420p"
            # Tagged BT.709 and converted with its matrix: what players assume for video, so the
            # colours a browser shows are the frames' own.
            context = stream.codec_context
            context.colorspace = context.color_primaries = context.color_trc = 1  # BT.709
            context.color_range = 1  # limited ("tv"), as H.264 and VP9 players expect
            for yuv in _yuv_frames(images):
                output.mux(stream.encode(yuv))
            output.mux(stream.encode(None))
        return path.read_bytes()


def _yuv_frames(images: list[Image.Image]) -> Iterator[av.VideoFrame]:
    """Each image as yuv420p by BT.709's matrix."""
    import av
    from av.video.reformatter import ColorRange, Colorspace

    for image in images:
        yield av.VideoFrame.from_image(image).reformat(  # type: ignore[no-untyped-call]
            format="yuv420p",
            dst_colorspace=Colorspace.ITU709,
            dst_color_range=ColorRange.MPEG,
        )


def _encode_webp(images: list[Image.Image], fps: int, details: str | None) -> bytes:
    """Animated WebP through Pillow. WebP keeps whole milliseconds a frame: each frame ends at
    its own rounded time, so the clip lasts frames/fps to the millisecond (8 ms a frame at
    120 fps would run 4 % slow)."""
    ends = [round((i + 1) * 1000 / fps) for i in range(len(images))]
    durations = [end - start for start, end in zip([0, *ends], ends, strict=False)]
    buffer = io.BytesIO()
    images[0].save(
        buffer,
        format="WEBP",
        save_all=True,
        append_images=images[1:],
        loop=0,
        duration=durations,
        lossless=False,
        quality=_WEBP_QUALITY,
        exif=b"" if details is None else exif_with_details(details),
    )
    return buffer.getvalue()


def _probe_webp(data: bytes) -> VideoInfo:
    with _webp(data) as image:
        width, height = image.size
    durations = _webp_durations_ms(data)
    frames, total_ms = max(len(durations), 1), sum(durations)
    fps = frames * 1000 / total_ms if total_ms else 0.0
    return VideoInfo(width, height, frames, fps, "webp", total_ms / 1000)


def _webp_durations_ms(data: bytes) -> list[int]:
    """Each frame's duration, read from the ANMF chunks (RIFF: fourcc, 32-bit little-endian size,
    payload padded to even; the duration is the 24 bits at payload offset 12) without decoding:
    Pillow gives a frame's duration only once it has decoded every frame up to it."""
    durations, offset = [], 12
    while offset + 8 <= len(data):
        size = int.from_bytes(data[offset + 4 : offset + 8], "little")
        if data[offset : offset + 4] == b"ANMF":
            durations.append(int.from_bytes(data[offset + 20 : offset + 23], "little"))
        offset += 8 + size + size % 2
    return durations


def _is_webp(data: bytes) -> bool:
    return data[:4] == _WEBP_MAGIC[0] and data[8:12] == _WEBP_MAGIC[1]


@contextlib.contextmanager
def _webp(data: bytes) -> Iterator[Image.Image]:
    """A WebP read from memory; ValueError when Pillow finds it broken, opening or decoding."""
    # Pillow's words for a file that is not an image, truncated, or of absurd size.
    broken = (OSError, SyntaxError, EOFError, Image.DecompressionBombError)
    try:
        with Image.open(io.BytesIO(data)) as image:
            yield image
    except broken as exc:
        raise ValueError(f"not a WebP kiln can read ({len(data)} bytes): {exc}") from None


@contextlib.contextmanager
def _opened(data: bytes) -> Iterator[av.container.InputContainer]:
    """An MP4 or WebM read from memory; ValueError when the bytes are no video FFmpeg reads,
    whether opening or decoding finds it out."""
    import av

    if not data:
        raise ValueError("video data is empty (0 bytes)")
    try:
        with av.open(io.BytesIO(data), "r") as container:
            yield container
    except av.FFmpegError as exc:
        raise ValueError(f"not a video kiln can read ({len(data)} bytes): {exc}") from None


def _format_of(container: av.container.InputContainer) -> VideoFormat:
    """mp4 or webm by FFmpeg's demuxer ("mov,mp4,..." and "matroska,webm" name families)."""
    names = container.format.name.split(",")
    if "mp4" in names:
        return "mp4"
    if "webm" in names:
        return "webm"
    raise ValueError(
        f"a {container.format.name!r} file is not a video kiln writes ({VIDEO_FORMATS})"
    )
