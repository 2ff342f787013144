"""Connection-level limits of the reference server: body size and read time, slow readers, bad text.

Fault injection found that a 300 MB body, invalid UTF-8 and a JSON lone surrogate (`"\\ud800"`)
were 500s, that a streaming client which never read held its connection (and its generation)
forever, and that a socket that stalled mid-request was never closed. Here:

- `read_json_body` refuses a declared Content-Length over `max_body_bytes` with 413 before reading
  any of it, and stops reading a chunked body as soon as it passes the limit; the body must arrive
  within `body_timeout_s` (408 and the connection closed); it must be UTF-8 (400) and JSON whose
  strings are valid Unicode (a lone surrogate cannot be encoded back to UTF-8 anywhere later: 400);
- `write_or_close` bounds each streamed write by `write_timeout_s`: a client that stopped reading
  fills the (deliberately small, `stream_buffer_bytes`) socket buffers, the write cannot drain, and
  the connection is aborted, which cancels its generation;
- a request head that has not fully arrived `header_timeout_s` after the connection opened (or after
  the previous response) closes the connection: aiohttp's keep-alive timer, which it arms at
  connect and which fires while the handler is idle waiting for a head, is set to this value.
"""

from __future__ import annotations

import asyncio
import json
import socket
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from .generation_jobs import ClientGone
from .server_requests import BadRequest

# A context-filling prompt is a few megabytes of JSON (ids or text); 64 MiB is far past any real request.
DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
DEFAULT_HEADER_TIMEOUT_S = 30.0
DEFAULT_BODY_TIMEOUT_S = 60.0
DEFAULT_WRITE_TIMEOUT_S = 30.0
# After a 413/408 the rest of the body is read and thrown away (never held) for this long before the
# socket closes, so that a client still sending gets to read the answer rather than a reset.
DEFAULT_LINGER_S = 2.0
# Socket send buffer and transport high-water mark of a streaming response: what a client that does
# not read can make the server hold for it before its writes block (and then time out).
DEFAULT_STREAM_BUFFER_BYTES = 256 * 1024
READ_CHUNK_BYTES = 1 << 16


@dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S
    stream_buffer_bytes: int = DEFAULT_STREAM_BUFFER_BYTES
    linger_s: float = DEFAULT_LINGER_S

    def runner_options(self) -> dict:
        """aiohttp's per-connection options: the keep-alive timer (armed at connect, firing while no
        request head is complete) is the header timeout; lingering after an unread body is bounded."""
        return {"keepalive_timeout": self.header_timeout_s, "lingering_time": self.linger_s}

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "header_timeout_s", "body_timeout_s", "write_timeout_s",
                     "stream_buffer_bytes", "linger_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")


class PayloadTooLarge(Exception):
    """The body is larger than the server accepts: HTTP 413, and the connection is closed unread."""

    status = 413


class BodyTimeout(Exception):
    """The body did not arrive in time: HTTP 408, and the connection is closed."""

    status = 408


class SlowReader(ClientGone):
    """A streaming client did not take what it was sent within the write timeout; its connection is gone."""


async def _read_capped(request: web.Request, limit: int) -> bytes:
    declared = request.content_length
    if declared is not None and declared > limit:
        raise PayloadTooLarge(f"the request body is {declared} bytes; this server accepts at most {limit}")
    parts: list[bytes] = []
    size = 0
    while chunk := await request.content.read(READ_CHUNK_BYTES):
        size += len(chunk)
        if size > limit:  # chunked, or a body longer than it declared: stop here, never hold it all
            raise PayloadTooLarge(f"the request body is over {limit} bytes; this server accepts at most {limit}")
        parts.append(chunk)
    return b"".join(parts)


async def read_json_body(request: web.Request, limits: ServerLimits) -> Any:
    """The request's JSON body within `limits`; typed errors for every way it can be wrong."""
    try:
        raw = await asyncio.wait_for(_read_capped(request, limits.max_body_bytes), limits.body_timeout_s)
    except TimeoutError:
        raise BodyTimeout(f"the request body did not arrive within {limits.body_timeout_s:g} s") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(f"the request body is not valid UTF-8 (byte {e.start}: {e.reason})") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadRequest(f"the request body is not JSON ({e.msg} at char {e.pos})") from None
    except RecursionError:
        raise BadRequest("the request body is JSON nested too deeply") from None
    _check_strings(body)
    return body


def _check_strings(value: Any) -> None:
    """Every string (keys included) must encode to UTF-8: JSON's \\ud800 escapes decode to lone surrogates."""
    stack = [value]
    while stack:  # iterative: json.loads already bounded the depth, this must not add a recursion limit
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                raise BadRequest(f"the request body holds a lone UTF-16 surrogate ({v[e.start]!r} escaped "
                                 "as \\u" + f"{ord(v[e.start]):04x}); strings must be valid Unicode") from None


def limit_stream_buffers(request: web.Request, limits: ServerLimits) -> None:
    """Keep what a non-reading client can make us buffer small, so its writes block (and time out) early."""
    transport = request.transport
    if transport is None:
        return
    transport.set_write_buffer_limits(high=limits.stream_buffer_bytes)
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, limits.stream_buffer_bytes)
        except OSError:  # a socket that refuses it keeps the kernel's default; the write timeout still holds
            pass


async def write_or_close(request: web.Request, resp: web.StreamResponse, data: bytes, limits: ServerLimits) -> None:
    """Write one piece of a streamed response, or abort the connection when the client does not read it."""
    try:
        await asyncio.wait_for(resp.write(data), limits.write_timeout_s)
    except TimeoutError:
        if request.transport is not None:
            request.transport.abort()  # close() would wait to flush what the client will never read
        raise SlowReader(f"the client read nothing for {limits.write_timeout_s:g} s") from None


def close_after(resp: web.StreamResponse) -> web.StreamResponse:
    """Close the connection once `resp` is sent: a rejected body is not read (or drained) further."""
    resp.force_close()
    return resp
