"""The one channel between the trusted grader and a sandboxed student process: framed JSON plus raw bytes.

A frame is a 16-byte prefix (header length, blob length), a JSON header, and the raw bytes of every tensor in
the message, in order. Tensors travel as {"__tensor__": index, "dtype": name, "shape": [...]} in the header;
nothing is ever unpickled, so whatever a student process writes can at worst be a wrong answer, which the
trusted side checks like any other. Sizes, dtypes and nesting are bounded before anything is allocated.
"""

from __future__ import annotations

import json
import socket
import struct

MAX_HEADER = 64 << 20  # bytes of JSON in one frame
MAX_BLOBS = 2 << 30  # bytes of tensor data in one frame
MAX_DEPTH = 32  # nesting of lists and dicts
_PREFIX = struct.Struct("<QQ")
DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")


class ChannelError(Exception):
    """The other side sent something that is not a well-formed frame, or hung up."""


def _torch():
    import torch

    return torch


def _encode(obj, blobs: list, depth: int = 0):
    if depth > MAX_DEPTH:
        raise ChannelError("message nested too deeply")
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (list, tuple)):
        return [_encode(v, blobs, depth + 1) for v in obj]
    if isinstance(obj, dict):
        return {str(k): _encode(v, blobs, depth + 1) for k, v in obj.items()}
    torch = _torch()
    if isinstance(obj, torch.Tensor):
        t = obj.detach().to("cpu").contiguous()
        name = str(t.dtype).removeprefix("torch.")
        if name not in DTYPES:
            raise ChannelError(f"tensors of dtype {name} cannot be sent")
        raw = t.view(torch.int16) if name in ("bfloat16", "float16") else t
        blobs.append(raw.numpy().tobytes() if t.numel() else b"")
        return {"__tensor__": len(blobs) - 1, "dtype": name, "shape": list(t.shape)}
    if hasattr(obj, "item") and hasattr(obj, "dtype"):  # a numpy scalar
        return obj.item()
    raise ChannelError(f"{type(obj).__name__} cannot be sent (JSON values and tensors only)")


def send(sock: socket.socket, obj) -> None:
    """Send one message (JSON values and tensors, nested in lists and dicts)."""
    blobs: list[bytes] = []
    header = json.dumps(_encode(obj, blobs)).encode()
    total = sum(len(b) for b in blobs)
    if len(header) > MAX_HEADER or total > MAX_BLOBS:
        raise ChannelError("message too large")
    sock.sendall(_PREFIX.pack(len(header), total) + header)
    for b in blobs:
        sock.sendall(b)


def _read(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], min(n - got, 1 << 22))
        if k == 0:
            raise ChannelError("the other side closed the channel")
        got += k
    return bytes(buf)


def recv(sock: socket.socket):
    """Receive one message; raises ChannelError for anything malformed, oversized or cut short."""
    nh, nb = _PREFIX.unpack(_read(sock, _PREFIX.size))
    if nh > MAX_HEADER or nb > MAX_BLOBS:
        raise ChannelError(f"frame too large ({nh} + {nb} bytes)")
    try:
        header = json.loads(_read(sock, nh))
    except (ValueError, RecursionError) as e:
        raise ChannelError(f"malformed header: {str(e)[:100]}") from None
    data = _read(sock, nb) if nb else b""
    offsets = _Blobs(data)
    return _decode(header, offsets, 0)


class _Blobs:
    def __init__(self, data: bytes):
        self.data, self.pos, self.next = data, 0, 0


def _decode(obj, blobs: _Blobs, depth: int):
    if depth > MAX_DEPTH:
        raise ChannelError("message nested too deeply")
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, list):
        return [_decode(v, blobs, depth + 1) for v in obj]
    if not isinstance(obj, dict):
        raise ChannelError(f"unexpected {type(obj).__name__} in a message")
    if "__tensor__" not in obj:
        return {k: _decode(v, blobs, depth + 1) for k, v in obj.items()}
    return _tensor(obj, blobs)


def _tensor(spec: dict, blobs: _Blobs):
    torch = _torch()
    dtype, shape, index = spec.get("dtype"), spec.get("shape"), spec.get("__tensor__")
    if dtype not in DTYPES or not isinstance(shape, list) or index != blobs.next \
            or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 2**40 for s in shape):
        raise ChannelError("malformed tensor in a message")
    blobs.next += 1
    numel = 1
    for s in shape:
        numel *= s
    size = numel * torch.empty((), dtype=getattr(torch, dtype)).element_size()
    if blobs.pos + size > len(blobs.data):
        raise ChannelError("tensor data cut short")
    chunk = bytearray(blobs.data[blobs.pos:blobs.pos + size])
    blobs.pos += size
    if numel == 0:
        return torch.empty(shape, dtype=getattr(torch, dtype))
    raw_dtype = torch.int16 if dtype in ("bfloat16", "float16") else getattr(torch, dtype)
    t = torch.frombuffer(chunk, dtype=raw_dtype).reshape(shape)
    return t.view(getattr(torch, dtype)) if raw_dtype is not getattr(torch, dtype) else t
