"""The generator-server wire format: length-prefixed JSON frames over one TCP connection, and the strict
conversion between frames and the message dataclasses of `types.py`.

A frame is a 4-byte big-endian length followed by that many bytes of UTF-8 JSON holding one object with a
`kind`. JSON and nothing else: no pickle, so a frame from the network can at worst be rejected, never run code.
Strict JSON: Python's `NaN`/`Infinity` extensions are refused in both directions (a non-finite log-prob or setting
is broken input, never a value to compute with).
Decoding checks every field's type and refuses unknown or missing keys, so a malformed frame fails at the edge with
a message naming the field instead of deep inside the engine. Tensors never travel here (see
`weight_sync/broadcast.py`); a `WeightUpdate` frame only says which tensors the broadcast will carry.

Trainer -> server kinds: hello, join_group, weights, generate, bye (each with the shared `token`).
Server -> trainer kinds: ready, group_joined, weights_loaded, rollouts, error.
"""

from __future__ import annotations

import json
import socket
import struct
from async_rlhf.types import (FieldError, GenerationRequest, RolloutBatch, WeightUpdate, check_fields, list_of,
                              nonneg, number, string)

PROTOCOL = 1
TOKEN_ENV = "ASYNC_RLHF_GENERATOR_TOKEN"  # where both ends read the shared token from
HELLO_MAX_BYTES = 64 << 10  # before authentication nobody may make the server allocate more than this
MESSAGE_MAX_BYTES = 1 << 30
_HEADER = struct.Struct(">I")


ProtocolError = FieldError  # a malformed frame or message: the same error the message types raise


class ConnectionClosed(ConnectionError):
    """The peer closed the connection."""


def keep_alive(sock: socket.socket, idle: int = 60, interval: int = 10, count: int = 6) -> None:
    """TCP keepalive: a connection whose peer's machine vanished (no FIN, no RST) is reported dead after about
    `idle + interval * count` seconds instead of two hours, so a blocked read cannot wait forever."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", count)):
        if hasattr(socket, name):  # Linux names; other systems keep their defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _refuse_constant(name: str):
    raise ProtocolError(f"frame holds {name}: only finite numbers may cross the wire")


def send_frame(sock: socket.socket, message: dict) -> None:
    body = json.dumps(message, separators=(",", ":"), allow_nan=False).encode()
    sock.sendall(_HEADER.pack(len(body)) + body)


def recv_frame(sock: socket.socket, max_bytes: int = MESSAGE_MAX_BYTES) -> dict:
    (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if size > max_bytes:
        raise ProtocolError(f"frame of {size} bytes exceeds the limit of {max_bytes}")
    try:
        message = json.loads(_recv_exact(sock, size), parse_constant=_refuse_constant)  # NaN, Infinity
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"frame is not JSON: {exc}") from exc
    if not isinstance(message, dict) or not isinstance(message.get("kind"), str):
        raise ProtocolError("frame is not an object with a 'kind'")
    return message


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionClosed("connection closed by peer")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def parse_address(address: str) -> tuple[str, int]:
    """'host:port' or '[ipv6]:port' -> (host, port)."""
    host, sep, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r} is not 'host:port'")
    return host, int(port)


# ---- messages -------------------------------------------------------------------------------------------------
def encode_request(request: GenerationRequest) -> dict:
    return {"kind": "generate", **request.to_dict()}


def decode_request(d: dict) -> GenerationRequest:
    return GenerationRequest.from_dict(d)


def encode_update(update: WeightUpdate) -> dict:
    if update.transport != "broadcast":
        raise ValueError(f"generator servers receive weights by broadcast, not {update.transport!r}")
    return {"kind": "weights", "version": update.version, "names": update.names, "dtypes": update.dtypes,
            "shapes": update.shapes, "num_bytes": update.num_bytes}


def decode_update(d: dict) -> WeightUpdate:
    f = decode_reply(d, "weights", {"version": nonneg, "names": list_of(string), "dtypes": list_of(string),
                                    "shapes": list_of(list_of(nonneg)), "num_bytes": nonneg})
    return WeightUpdate(transport="broadcast", **f)


def encode_rollouts(batch: RolloutBatch) -> dict:
    """The batch's own serialisation, less its prompts (the trainer has them: it sent the request)."""
    return {**batch.to_dict(), "kind": "rollouts", "prompt_token_ids": []}


def decode_rollouts(d: dict, request: GenerationRequest, generator_id: int) -> RolloutBatch:
    """Rollouts for `request` (the one the trainer sent: its prompts are not sent back); tagged with the version the
    server had loaded, exactly like a local generator's."""
    if not isinstance(d, dict):
        raise ProtocolError("rollouts: expected an object")
    batch = RolloutBatch.from_dict({**d, "prompt_token_ids": request.prompt_token_ids, "generator_id": generator_id})
    if (batch.batch_id, batch.chunk, batch.prompt_ids) != (request.batch_id, request.chunk, request.prompt_ids):
        raise ProtocolError(f"rollouts for batch {batch.batch_id} chunk {batch.chunk} do not match the request")
    if any(len(g) != request.settings.n for g in batch.completions):
        raise ProtocolError(f"rollouts for batch {batch.batch_id}: expected {len(request.prompt_ids)} x "
                            f"{request.settings.n} completions")
    return batch


def decode_reply(d: dict, kind: str, required: dict) -> dict:
    return check_fields(d, kind, required, ignore=("kind", "token"))


INT, FLOAT, STR = nonneg, number, string
