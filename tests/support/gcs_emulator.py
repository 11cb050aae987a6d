"""gcp-storage-emulator, as its own command starts it, but reading a multipart upload's parts byte for byte.

gcsfs uploads an object smaller than its block size as one multipart/related request whose lines end in a
bare LF: ``...\\n\\n<data>\\n--==0==--``. The emulator hands the body to Python's email parser, which takes
CR LF as the line end before a boundary: an object whose last byte is CR lost that byte (1 random object in
256; the suite's CI met one, a 3 MiB blob stored 1 byte short). Here the parts are split where the client
put its boundaries, with the line end its first boundary line used; and each connection is served in a
thread of its own (below). Everything else is the emulator's.

Usage (as ``gcp-storage-emulator``): python tests/support/gcs_emulator.py start --host H --port P --in-memory
"""

import json
import sys
from email.message import Message

from gcp_storage_emulator import server
from gcp_storage_emulator.__main__ import main

_emulators_read_data = server._read_data


def _param(header: str, name: str) -> str | None:
    message = Message()
    message["Content-Type"] = header
    return message.get_param(name)


def related_parts(raw: bytes, boundary: str) -> list[tuple[dict[str, str], bytes]]:
    """The (headers, body) of each part of a multipart/related ``raw``, bodies exact to the byte."""
    first = b"--" + boundary.encode()
    start = raw.index(first) + len(first)
    eol = b"\r\n" if raw[start : start + 2] == b"\r\n" else b"\n"
    delimiter = eol + first
    parts = []
    for chunk in raw[start:].split(delimiter):  # each chunk begins with its boundary line's end
        if chunk.startswith(b"--"):  # the close delimiter: what follows it is the epilogue
            break
        chunk = chunk[len(eol) :]
        head, body = (b"", chunk[len(eol) :]) if chunk.startswith(eol) else chunk.split(eol + eol, 1)
        headers = {}
        for line in head.decode("latin-1").split(eol.decode()) if head else []:
            key, _, value = line.partition(":")
            headers[key.strip().lower()] = value.strip()
        parts.append((headers, body))
    return parts


def _read_data(request_handler, query):
    content_type = request_handler.headers.get("Content-Type") or ""
    if not content_type.startswith("multipart/related"):
        return _emulators_read_data(request_handler, query)
    raw = server._decode_raw_data(server._read_raw_data(request_handler), request_handler)
    if not raw:
        return None
    (_, meta), (headers, content) = related_parts(raw, _param(content_type, "boundary"))
    return {
        "meta": json.loads(meta),
        "content": content,
        "content-type": headers.get("content-type", "application/octet-stream").split(";")[0].strip(),
    }


server._read_data = _read_data
# The emulator serves one connection at a time (http.server.HTTPServer): a client that holds a connection
# open without finishing a request stalls every other client until its read timeout (60 s; the suite's CI
# met it once, two GCS tests on one worker timing out together). Each connection gets a thread here.
server.server.HTTPServer = server.server.ThreadingHTTPServer

if __name__ == "__main__":
    sys.exit(main())
