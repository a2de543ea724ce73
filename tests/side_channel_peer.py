"""A peer of vLLM's NIXL side channel, as the side-channel tests play it: vLLM's handshake
request on a socket, and a one-off REQ socket, plain or with CURVE keys of its own."""
from __future__ import annotations

import contextlib

import msgspec
import zmq


def ask(sock, timeout_ms: int) -> bytes | None:
    """vLLM's handshake request (GET_META_MSG, pp rank, tp rank); the metadata, or None if no
    answer within ``timeout_ms``."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import GET_META_MSG

    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    sock.setsockopt(zmq.SNDTIMEO, timeout_ms)  # a REQ socket with no live pipe blocks on send
    try:
        sock.send(msgspec.msgpack.encode((GET_META_MSG, 0, 0)))
        return sock.recv_multipart()[0]
    except zmq.Again:
        return None


@contextlib.contextmanager
def peer(path: str, curve: tuple[bytes, bytes, bytes] | None = None):
    """A REQ socket connected to ``path`` in its own context: plain, or a CURVE client with
    ``curve`` = (server public key, own public key, own secret key)."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = curve
        sock.connect(path)
        yield sock
    finally:
        ctx.destroy(linger=0)
