"""The one redaction function: URL credentials and secret query values become `***`, in a bare
URL or in a message quoting one; everything else comes back byte for byte."""

from __future__ import annotations

import pytest
from hp_data.redact import redact, redact_data

CASES = [
    ("https://user:s3cr3t@host/x.jsonl", "https://***:***@host/x.jsonl"),
    ("https://tok3n@host:8443/a/b.jsonl", "https://***@host:8443/a/b.jsonl"),
    ("s3://AKIAKEY:SECRET@bucket/in/a.jsonl", "s3://***:***@bucket/in/a.jsonl"),
    ("http://u:p@127.0.0.1:9/x?y=1", "http://***:***@127.0.0.1:9/x?y=1"),
    (
        "https://b.s3.amazonaws.com/a.jsonl?X-Amz-Algorithm=AWS4-HMAC-SHA256"
        "&X-Amz-Credential=AKIA%2F20260101&X-Amz-Signature=abc123&X-Amz-Expires=60",
        "https://b.s3.amazonaws.com/a.jsonl?X-Amz-Algorithm=AWS4-HMAC-SHA256"
        "&X-Amz-Credential=***&X-Amz-Signature=***&X-Amz-Expires=60",
    ),
    (
        "https://h/x?x-amz-security-token=T0K&sig=S1G&SIGNATURE=S&api_key=K#frag",
        "https://h/x?x-amz-security-token=***&sig=***&SIGNATURE=***&api_key=***#frag",
    ),
    (
        "https://g.com/o?X-Goog-Signature=a;X-Goog-Credential=b&key=c&token=d&access_token=e",
        "https://g.com/o?X-Goog-Signature=***;X-Goog-Credential=***&key=***&token=***&access_token=***",
    ),
    (
        "https://h/o?AWSAccessKeyId=A&Signature=B&password=C",
        "https://h/o?AWSAccessKeyId=***&Signature=***&password=***",
    ),
    # Free text: an error line, an aiohttp message quoting the URL, two URLs.
    (
        "https://user:pw@host/x.jsonl: cannot list: 401, message='Unauthorized', "
        "url='https://user:pw@host/x.jsonl?token=t'",
        "https://***:***@host/x.jsonl: cannot list: 401, message='Unauthorized', "
        "url='https://***:***@host/x.jsonl?token=***'",
    ),
    ("https://h/a.jsonl?sig=***:12: bad", "https://h/a.jsonl?sig=***:12: bad"),  # a location
    ("a http://a:b@h/1 and (s3://k:s@b/2)", "a http://***:***@h/1 and (s3://***:***@b/2)"),
]
UNCHANGED = [
    "https://host/x.jsonl",
    "https://host:8443/a%20b/c.jsonl?page=2&keyword=x&monkey=1#top",
    "hf://datasets/org/name@main/data/train.jsonl",  # an @ in the path is a revision
    "memory:///bad/x.jsonl:3: malformed JSON",
    "/data/user:pass@x.jsonl: no such file",  # a local path: no scheme
    "mail me at user@example.com; key=value",
    "",
]


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_secrets_become_stars(text, expected):
    assert redact(text) == expected
    assert redact(expected) == expected  # redacting twice changes nothing more


@pytest.mark.parametrize("text", UNCHANGED)
def test_text_without_secrets_is_byte_identical(text):
    assert redact(text) == text


def test_json_data_is_redacted_in_every_string():
    data = {"path": "https://u:p@h/x", "https://u:p@h/k": [1, ("s3://k:s@b/y", None)], "n": 2}
    assert redact_data(data) == {
        "path": "https://***:***@h/x", "https://***:***@h/k": [1, ["s3://***:***@b/y", None]],
        "n": 2,
    }  # fmt: skip
