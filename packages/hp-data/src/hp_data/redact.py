"""Credentials out of what hp prints and stores: logs are shared, pasted into issues and kept by
schedulers, so a URL's user info and its secret-bearing query parameters become `***` (as
pip's `redact_auth_from_url` and fsspec do). Text without such a URL comes back unchanged."""

from __future__ import annotations

import re
from typing import Any

# Query parameters that carry a secret: presigned S3 and GCS URLs, SAS tokens, API keys.
SECRET_PARAMETERS = (
    "X-Amz-Signature", "X-Amz-Credential", "X-Amz-Security-Token", "X-Goog-Signature",
    "X-Goog-Credential", "sig", "signature", "token", "access_token", "api_key", "key",
    "password", "AWSAccessKeyId", "Signature",
)  # fmt: skip
MASK = "***"

# A URL inside free text: a scheme, then anything up to whitespace or a quote or bracket (an
# exception's message quotes the URL it failed on: url='https://...').
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>()\[\]{}`]*")
_PARAMETER = re.compile(
    # A value already `***` stays as it is, and what follows it (`:LINE` in a message) too.
    r"([?&;](?:" + "|".join(map(re.escape, SECRET_PARAMETERS)) + r")=)(?:\*\*\*|[^&;#]*)",
    re.IGNORECASE,
)


_MASKED_VALUE = r"\g<1>" + MASK


def _redact_url(match: re.Match[str]) -> str:
    url = match.group(0)
    scheme, rest = url.split("://", 1)
    end = len(rest)
    for stop in "/?#":  # the authority: up to the path, query or fragment
        if stop in rest:
            end = min(end, rest.index(stop))
    authority, tail = rest[:end], rest[end:]
    if "@" in authority:
        userinfo, host = authority.rsplit("@", 1)
        authority = (f"{MASK}:{MASK}" if ":" in userinfo else MASK) + "@" + host
    return f"{scheme}://{authority}{_PARAMETER.sub(_MASKED_VALUE, tail)}"


def redact(text: str) -> str:
    """`text` (a URL, or a message quoting URLs) with every URL's user, password and secret
    query parameter values replaced by `***`."""
    return _URL.sub(_redact_url, text) if "://" in text else text


def redact_data(value: Any) -> Any:
    """`value` (JSON-ready data: dicts, lists, strings) with `redact` applied to every string,
    keys included: what hp writes as JSON, to stdout or to disk."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {redact_data(k): redact_data(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact_data(v) for v in value]
    return value
