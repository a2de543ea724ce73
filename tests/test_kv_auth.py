"""The KV secret's challenge-response (app.engine.kv_auth) over a socket pair, without NIXL."""
from __future__ import annotations

import json
import socket
import threading

import pytest

from app.engine import kv_auth

SECRET = b"s" * 32


def handshake(server_secret, client_secret):
    """(server admitted?, client's KVAuthError message or None)."""
    a, b = socket.socketpair()
    admitted = []
    t = threading.Thread(target=lambda: admitted.append(kv_auth.admit(server_secret, a.makefile("rb"),
                                                                      a.makefile("wb"))))
    t.start()
    try:
        kv_auth.authenticate(client_secret, "peer", b.makefile("rb"), b.makefile("wb"))
        err = None
    except kv_auth.KVAuthError as e:
        err = str(e)
    b.close()
    t.join(10)
    a.close()
    return admitted[0], err


@pytest.mark.parametrize("server,client,admitted,error", [
    (SECRET, SECRET, True, None),
    (SECRET, b"t" * 32, False, "refused this node"),
    (SECRET, None, False, "asks for the KV secret"),
    (None, None, True, None),  # loopback, no secret on either side
    (None, SECRET, True, "does not ask for the KV secret"),  # a node with the secret trusts no such server
])
def test_only_peers_holding_the_secret_get_past_the_first_exchange(server, client, admitted, error):
    got_admitted, got_error = handshake(server, client)
    assert got_admitted == admitted
    assert (got_error is None) if error is None else (error in got_error)


def test_a_server_without_the_secret_cannot_pass_as_one():
    """A fake server that says ok to any answer is caught by its missing proof."""
    a, b = socket.socketpair()

    def fake():
        f, w = a.makefile("rb"), a.makefile("wb")
        w.write(json.dumps({"challenge": "c" * 64}).encode() + b"\n")
        w.flush()
        f.readline()
        w.write(json.dumps({"ok": True, "mac": "00" * 32}).encode() + b"\n")
        w.flush()

    t = threading.Thread(target=fake)
    t.start()
    with pytest.raises(kv_auth.KVAuthError, match="does not hold"):
        kv_auth.authenticate(SECRET, "peer", b.makefile("rb"), b.makefile("wb"))
    t.join(10)


def test_an_answer_is_bound_to_its_challenge_and_side():
    mac = kv_auth.answer(SECRET, "client", "abc")
    assert kv_auth.check(SECRET, "client", "abc", mac)
    assert not kv_auth.check(SECRET, "client", "abd", mac)  # a replayed answer fails a new challenge
    assert not kv_auth.check(SECRET, "server", "abc", mac)  # a client's answer is no server proof
    assert not kv_auth.check(b"t" * 32, "client", "abc", mac) and not kv_auth.check(SECRET, "client", "abc", None)


def test_the_secret_comes_from_the_environment_or_a_file(monkeypatch, tmp_path):
    monkeypatch.delenv(kv_auth.KV_SECRET_ENV, raising=False)
    monkeypatch.delenv(kv_auth.KV_SECRET_FILE_ENV, raising=False)
    assert kv_auth.load_secret() is None
    f = tmp_path / "kv"
    f.write_text("from-a-file-0123456789\n")
    monkeypatch.setenv(kv_auth.KV_SECRET_FILE_ENV, str(f))
    assert kv_auth.load_secret() == b"from-a-file-0123456789"
    monkeypatch.setenv(kv_auth.KV_SECRET_ENV, "from-the-env-0123456789")
    assert kv_auth.load_secret() == b"from-the-env-0123456789"
    monkeypatch.setenv(kv_auth.KV_SECRET_ENV, "short")
    with pytest.raises(kv_auth.KVAuthError, match="16 bytes"):
        kv_auth.load_secret()
    assert kv_auth.is_loopback("127.0.0.1") and kv_auth.is_loopback("::1") and kv_auth.is_loopback("localhost")
    assert not kv_auth.is_loopback("0.0.0.0") and not kv_auth.is_loopback("10.0.0.5")
