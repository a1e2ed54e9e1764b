"""Framing between the pool and its workers: a JSON header plus raw byte blobs.

JSON rather than pickle so that a compromised worker cannot run code in the trainer by
what it sends back. A frame is `u32 header_len | header | blob_0 | blob_1 ...` where the
header's "blobs" field lists the blob lengths; `pack` turns every bytes value anywhere in
the message into a blob reference `{"blob": i}`.
"""
import json
import os
import select
import struct
import time

_LEN = struct.Struct(">I")
MAX_HEADER = 1 << 24


class Closed(EOFError):
    """The other end closed the channel."""


class Deadline(TimeoutError):
    """No complete frame arrived before the deadline."""


def _strip_blobs(value, blobs: list):
    if isinstance(value, (bytes, bytearray, memoryview)):
        blobs.append(bytes(value))
        return {"blob": len(blobs) - 1}
    if isinstance(value, dict):
        return {k: _strip_blobs(v, blobs) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strip_blobs(v, blobs) for v in value]
    return value


def _restore_blobs(value, blobs: list):
    if isinstance(value, dict):
        if set(value) == {"blob"}:
            return blobs[value["blob"]]
        return {k: _restore_blobs(v, blobs) for k, v in value.items()}
    if isinstance(value, list):
        return [_restore_blobs(v, blobs) for v in value]
    return value


def pack(message: dict) -> bytes:
    blobs = []
    header = _strip_blobs(message, blobs)
    header["blobs"] = [len(b) for b in blobs]
    head = json.dumps(header, separators=(",", ":")).encode()
    return b"".join([_LEN.pack(len(head)), head, *blobs])


def send(fd: int, message: dict) -> None:
    view = memoryview(pack(message))
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes:
    chunks, got = [], 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise Deadline(f"frame not complete after deadline ({got}/{n} bytes)")
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            raise Closed("channel closed")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def recv(fd: int, deadline: float | None = None, max_bytes: int | None = None) -> dict:
    """Reads one frame; `deadline` is a time.monotonic() value or None to block."""
    (head_len,) = _LEN.unpack(_read_exact(fd, _LEN.size, deadline))
    if head_len > MAX_HEADER:
        raise ValueError(f"frame header of {head_len} bytes exceeds {MAX_HEADER}")
    header = json.loads(_read_exact(fd, head_len, deadline))
    sizes = header.pop("blobs")
    if max_bytes is not None and sum(sizes) > max_bytes:
        raise ValueError(f"frame of {sum(sizes)} bytes exceeds {max_bytes}")
    blobs = [_read_exact(fd, n, deadline) for n in sizes]
    return _restore_blobs(header, blobs)
