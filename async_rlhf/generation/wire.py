"""The generator-server wire format: length-prefixed JSON frames over one TCP connection, and the strict
conversion between frames and the message dataclasses of `types.py`.

A frame is a 4-byte big-endian length followed by that many bytes of UTF-8 JSON holding one object with a
`kind`. JSON and nothing else: no pickle, so a frame from the network can at worst be rejected, never run code.
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
from dataclasses import asdict

from async_rlhf.types import Completion, GenerationRequest, RolloutBatch, SamplingSettings, WeightUpdate

PROTOCOL = 1
TOKEN_ENV = "ASYNC_RLHF_GENERATOR_TOKEN"  # where both ends read the shared token from
HELLO_MAX_BYTES = 64 << 10  # before authentication nobody may make the server allocate more than this
MESSAGE_MAX_BYTES = 1 << 30
_HEADER = struct.Struct(">I")


class ProtocolError(ValueError):
    """A frame that is not a well-formed message of this protocol."""


class ConnectionClosed(ConnectionError):
    """The peer closed the connection."""


def keep_alive(sock: socket.socket, idle: int = 60, interval: int = 10, count: int = 6) -> None:
    """TCP keepalive: a connection whose peer's machine vanished (no FIN, no RST) is reported dead after about
    `idle + interval * count` seconds instead of two hours, so a blocked read cannot wait forever."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", count)):
        if hasattr(socket, name):  # Linux names; other systems keep their defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def send_frame(sock: socket.socket, message: dict) -> None:
    body = json.dumps(message, separators=(",", ":")).encode()
    sock.sendall(_HEADER.pack(len(body)) + body)


def recv_frame(sock: socket.socket, max_bytes: int = MESSAGE_MAX_BYTES) -> dict:
    (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if size > max_bytes:
        raise ProtocolError(f"frame of {size} bytes exceeds the limit of {max_bytes}")
    try:
        message = json.loads(_recv_exact(sock, size))
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


# ---- field checks ---------------------------------------------------------------------------------------------
def _fields(d: dict, kind: str, required: dict, optional: dict | None = None) -> dict:
    optional = optional or {}
    allowed = {"kind", "token", *required, *optional}
    unknown = set(d) - allowed
    missing = set(required) - set(d)
    if unknown or missing:
        raise ProtocolError(f"{kind}: unknown field(s) {sorted(unknown)}, missing field(s) {sorted(missing)}")
    out = {}
    for name, check in {**required, **optional}.items():
        if name in d:
            try:
                out[name] = check(d[name])
            except (TypeError, ValueError) as exc:
                raise ProtocolError(f"{kind}.{name}: {exc}") from None
    return out


def _int(x):
    if not isinstance(x, int) or isinstance(x, bool):
        raise TypeError(f"expected an integer, got {type(x).__name__}")
    return x


def _nonneg(x):
    if _int(x) < 0:
        raise ValueError(f"expected >= 0, got {x}")
    return x


def _float(x):
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"expected a number, got {type(x).__name__}")
    return float(x)


def _str(x):
    if not isinstance(x, str):
        raise TypeError(f"expected a string, got {type(x).__name__}")
    return x


def _list(item):
    def check(x):
        if not isinstance(x, list):
            raise TypeError(f"expected a list, got {type(x).__name__}")
        return [item(v) for v in x]
    return check


def _optional(check):
    return lambda x: None if x is None else check(x)


# ---- messages -------------------------------------------------------------------------------------------------
def encode_request(request: GenerationRequest) -> dict:
    return {"kind": "generate", **asdict(request)}


def decode_request(d: dict) -> GenerationRequest:
    f = _fields(d, "generate", {"batch_id": _nonneg, "prompt_ids": _list(_nonneg),
                                "prompt_token_ids": _list(_list(_nonneg)), "settings": _settings,
                                "chunk": _nonneg, "num_chunks": _nonneg})
    if len(f["prompt_ids"]) != len(f["prompt_token_ids"]):
        raise ProtocolError("generate: prompt_ids and prompt_token_ids differ in length")
    return GenerationRequest(**f)


def _settings(d) -> SamplingSettings:
    if not isinstance(d, dict):
        raise TypeError("expected an object")
    return SamplingSettings(**_fields(d, "settings", {"max_new_tokens": _nonneg, "temperature": _float,
                                                      "top_p": _float, "top_k": _int, "n": _nonneg,
                                                      "seed": _optional(_int)}))


def encode_update(update: WeightUpdate) -> dict:
    if update.transport != "broadcast":
        raise ValueError(f"generator servers receive weights by broadcast, not {update.transport!r}")
    return {"kind": "weights", "version": update.version, "names": update.names, "dtypes": update.dtypes,
            "shapes": update.shapes, "num_bytes": update.num_bytes}


def decode_update(d: dict) -> WeightUpdate:
    f = _fields(d, "weights", {"version": _nonneg, "names": _list(_str), "dtypes": _list(_str),
                               "shapes": _list(_list(_nonneg)), "num_bytes": _nonneg})
    return WeightUpdate(transport="broadcast", **f)


def encode_rollouts(batch: RolloutBatch) -> dict:
    return {"kind": "rollouts", "batch_id": batch.batch_id, "policy_version": batch.policy_version,
            "prompt_ids": batch.prompt_ids, "completions": [[asdict(c) for c in group] for group in batch.completions],
            "seconds": batch.seconds, "chunk": batch.chunk, "num_chunks": batch.num_chunks}


def decode_rollouts(d: dict, request: GenerationRequest, generator_id: int) -> RolloutBatch:
    """Rollouts for `request` (the one the trainer sent: its prompts are not sent back); tagged with the version the
    server had loaded, exactly like a local generator's."""
    f = _fields(d, "rollouts", {"batch_id": _nonneg, "policy_version": _nonneg, "prompt_ids": _list(_nonneg),
                                "completions": _list(_list(_completion)), "seconds": _float, "chunk": _nonneg,
                                "num_chunks": _nonneg})
    if (f["batch_id"], f["chunk"], f["prompt_ids"]) != (request.batch_id, request.chunk, request.prompt_ids):
        raise ProtocolError(f"rollouts for batch {f['batch_id']} chunk {f['chunk']} do not match the request")
    if len(f["completions"]) != len(request.prompt_ids) or any(len(g) != request.settings.n for g in f["completions"]):
        raise ProtocolError(f"rollouts for batch {f['batch_id']}: expected {len(request.prompt_ids)} x "
                            f"{request.settings.n} completions")
    return RolloutBatch(batch_id=f["batch_id"], generator_id=generator_id, policy_version=f["policy_version"],
                        prompt_ids=f["prompt_ids"], prompt_token_ids=request.prompt_token_ids,
                        completions=f["completions"], seconds=f["seconds"], chunk=f["chunk"],
                        num_chunks=f["num_chunks"])


def _completion(d) -> Completion:
    if not isinstance(d, dict):
        raise TypeError("expected an object")
    f = _fields(d, "completion", {"token_ids": _list(_nonneg), "logprobs": _list(_float), "finish_reason": _str})
    if len(f["token_ids"]) != len(f["logprobs"]) or f["finish_reason"] not in ("stop", "length"):
        raise ValueError("token_ids and logprobs differ in length, or finish_reason is not 'stop'/'length'")
    return Completion(**f)


def decode_reply(d: dict, kind: str, required: dict) -> dict:
    return _fields(d, kind, required)


INT, FLOAT, STR = _nonneg, _float, _str
