"""Secrets never printed: one helper that masks passwords in URLs and known secret values in any
text (doctor's lines, CLI errors, log records)."""

from __future__ import annotations

import re
from collections.abc import Iterable

MASK = "***"
# Any user:password@ (or a bare password@) after scheme://, masked whole as ***@.
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^@/\s]+@")
# Query parameters that carry credentials (redis-py's password=, presigned X-Amz-Signature...).
_SECRET_PARAMS = re.compile(
    r"(?i)(?P<name>[?&](?:password|ssl_password|x-amz-signature|x-amz-security-token|"
    r"x-amz-credential|signature|token|secret)=)[^&\s]+"
)


def redact(text: str, secrets: Iterable[str | None] = ()) -> str:
    """text with URL passwords, credential query parameters and every given secret masked."""
    text = _USERINFO.sub(lambda m: f"{m['scheme']}{MASK}@", text)
    text = _SECRET_PARAMS.sub(lambda m: f"{m['name']}{MASK}", text)
    for secret in sorted({s for s in secrets if s and len(s) >= 4}, key=len, reverse=True):
        text = text.replace(secret, MASK)
    return text
