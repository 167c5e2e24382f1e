"""Where kiln's generation details ride inside a file, for every format it writes: the key its
containers name them by (a PNG text chunk, an MP4 or WebM metadata tag) and EXIF UserComment's
encoding of them (a WebP, still or animated, and a JPEG). worker.files.details writes and reads
an image's; worker.files.video a video's."""

from __future__ import annotations

from PIL import ExifTags, Image

DETAILS_KEY = "kiln"  # the PNG text chunk and the video metadata tag holding the JSON
_UNICODE = b"UNICODE\x00"  # EXIF UserComment's 8-byte character code


def exif_with_details(document: str, software: str | None = None) -> bytes:
    """An EXIF block with the details JSON in UserComment (character code UNICODE: UTF-16 in the
    block's byte order), as a WebP or JPEG carries it, still or animated (worker.files.video)."""
    exif = Image.Exif()
    if software is not None:
        exif[ExifTags.Base.Software] = software
    codec = "utf-16-le" if exif.endian == "<" else "utf-16-be"  # as Exif.tobytes() writes
    exif.get_ifd(ExifTags.IFD.Exif)[ExifTags.Base.UserComment] = _UNICODE + document.encode(codec)
    return exif.tobytes()


def details_from_exif(exif: Image.Exif) -> str | None:
    """The details JSON in an EXIF UserComment of character code UNICODE; None when there is none.
    UnicodeDecodeError for a comment that is not UTF-16."""
    comment = exif.get_ifd(ExifTags.IFD.Exif).get(ExifTags.Base.UserComment)
    if not isinstance(comment, bytes) or not comment.startswith(_UNICODE):
        return None
    body = comment[len(_UNICODE) :]
    # The JSON opens with "{": its zero byte says the byte order, whatever the EXIF header says.
    return body.decode("utf-16-be" if body[:1] == b"\x00" else "utf-16-le")
