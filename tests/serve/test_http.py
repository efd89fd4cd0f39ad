"""The server's HTTP connections, through raw sockets: requests the parser cannot read, headers
that do not arrive in time, connections past the cap, and the members of uvicorn's protocol
that eagle_jax.serve.app relies on (an upgrade that changes them fails here).

The engine is a stub: nothing here reaches it (tests/serve/test_app.py serves a real one).
"""

from __future__ import annotations

import inspect
import json
import logging
import socket
import threading
import time

import pytest
from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle

from eagle_jax.serve.app import Server, create_app
from eagle_jax.serve.limits import Limits, bind

HEADER_TIMEOUT_S = 0.5  # (asserted from 0.9x: the event loop's timer may fire a few ms early under load)
BODY_TIMEOUT_S = 2.0


class _NoEngine:
    """The engine interface, for routes that never submit."""
    tokenizer, vocab_size, context_limit = None, 16, 64

    def load(self):
        return 0, 0

    def info(self):
        return {"draft": "none"}

    def close(self):
        pass


def _serve(limits: Limits):
    engine = _NoEngine()
    server = Server(create_app(engine, model_name="m", limits=limits), bind("127.0.0.1", 0), engine, 5.0, limits)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture(scope="module")
def port():
    server = _serve(Limits(header_timeout_s=HEADER_TIMEOUT_S, body_timeout_s=BODY_TIMEOUT_S))
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def _until_closed(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    reply = b""
    while chunk := s.recv(65536):
        reply += chunk
    return reply


def _exchange(port: int, data: bytes) -> tuple[bytes, float]:
    """Send `data`, read to the server's close: the reply and the seconds it took."""
    t = time.perf_counter()  # before the connection: the server's clock starts when it accepts
    with _connect(port) as s:
        s.sendall(data)
        return _until_closed(s), time.perf_counter() - t


def _status_and_error(reply: bytes) -> tuple[int, dict]:
    head, body = reply.split(b"\r\n\r\n", 1)
    assert b"content-type: application/json" in head.lower() and b"connection: close" in head.lower(), head
    return int(head.split(b" ", 2)[1]), json.loads(body)["error"]


GET = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
POST = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


# ---------------------------------------------------------------------------- malformed HTTP


@pytest.mark.parametrize("data, status, says", [
    (POST + b"Content-Length: abc\r\n\r\n{}", 400, "bad Content-Length"),
    (POST + b"Content-Length: -2\r\n\r\n{}", 400, "bad Content-Length"),
    (POST + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}", 400, "conflicting Content-Length headers"),
    (POST + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n", 400, "illegal chunk header: b'zz"),
    (POST + b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n-1\r\n\r\n", 400, "illegal chunk header: b'-1"),
    (b"HELLO THERE\r\n\r\n", 400, "illegal request line: b'HELLO THERE'"),
    (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", 400, "illegal request line"),  # TLS to plain HTTP
    (b"GET /health HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n", 400, "illegal header line: b'no colon here'"),
    (b"GET /health HTTP/1.1\r\n\r\n", 400, "Missing mandatory Host: header"),
    (POST + b"Transfer-Encoding: gzip\r\n\r\n", 501, "Only Transfer-Encoding: chunked is supported"),
    (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000, 431, "the request headers are over 16384 bytes"),
])
def test_malformed_http_gets_an_error_saying_what_was_wrong(port, caplog, data, status, says):
    reply, _ = _exchange(port, data)
    got, err = _status_and_error(reply)
    assert got == status and err["message"].startswith(f"malformed HTTP request: {says}"), err
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    assert _exchange(port, GET.replace(b"Host: x", b"Host: x\r\nConnection: close"))[0].startswith(
        b"HTTP/1.1 200")  # the server goes on
    assert "disconnected" not in caplog.text  # a bad chunk mid-body is not a client that left
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], caplog.text


# ---------------------------------------------------------------------------- header timeout


def test_unfinished_headers_get_a_408_and_are_closed(port):
    reply, seconds = _exchange(port, GET[:-2])  # the blank line that ends the headers never comes
    status, err = _status_and_error(reply)
    assert status == 408 and err["message"] == \
        f"the request headers did not arrive within {HEADER_TIMEOUT_S:g} s (--header-timeout-s)"
    assert 0.9 * HEADER_TIMEOUT_S <= seconds < HEADER_TIMEOUT_S + 5


def test_a_byte_at_a_time_does_not_reset_the_header_clock(port):
    """A slowloris client: each byte arrives well within the timeout, the headers never do."""
    t = time.perf_counter()  # before the connection: the server's clock starts when it accepts
    with _connect(port) as s:
        try:
            for byte in GET[:-2] + b"X-Slow: " + b"y" * 1000:
                s.send(bytes([byte]))
                time.sleep(HEADER_TIMEOUT_S / 5)
        except (BrokenPipeError, ConnectionResetError):
            pass
        reply = _until_closed(s)
        seconds = time.perf_counter() - t
    assert _status_and_error(reply)[0] == 408 and seconds < HEADER_TIMEOUT_S + 5


def test_an_idle_connection_is_closed_without_a_reply(port):
    t = time.perf_counter()  # before the connection: the server's clock starts when it accepts
    with _connect(port) as s:
        assert _until_closed(s) == b""
        assert 0.9 * HEADER_TIMEOUT_S <= time.perf_counter() - t < HEADER_TIMEOUT_S + 5


def test_the_clock_restarts_for_each_request_on_a_kept_alive_connection(port):
    with _connect(port) as s:
        for _ in range(2):  # whole requests, each sent before the clock runs out
            time.sleep(HEADER_TIMEOUT_S * 0.6)
            s.sendall(GET)
            assert s.recv(65536).startswith(b"HTTP/1.1 200")
        s.sendall(GET[:10])  # then a third that stops halfway
        assert _status_and_error(_until_closed(s))[0] == 408
    with _connect(port) as s:  # idle after a response: closed on this clock, not uvicorn's 5 s keep-alive
        s.sendall(GET)
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
        t = time.perf_counter()
        assert _until_closed(s) == b"" and time.perf_counter() - t < HEADER_TIMEOUT_S + 3


def test_a_slow_body_is_the_body_timeout_not_the_header_one(port):
    """Once the headers are in, their clock stops: the body has --body-timeout-s."""
    with _connect(port) as s:
        t = time.perf_counter()
        s.sendall(POST + b"Content-Length: 20\r\n\r\n{")
        time.sleep(HEADER_TIMEOUT_S * 2)
        s.sendall(b'"prompt": "hi"')
        status, err = _status_and_error(_until_closed(s))
    assert status == 408 and f"the body did not arrive within {BODY_TIMEOUT_S:g} s" in err["message"]
    assert time.perf_counter() - t >= BODY_TIMEOUT_S


# ---------------------------------------------------------------------------- connection cap


def test_a_connection_past_the_cap_gets_a_503_and_is_closed():
    server = _serve(Limits(max_connections=2))
    port = server.server_address[1]
    try:
        held = [_connect(port), _connect(port)]
        time.sleep(0.2)  # the server has taken both
        reply, _ = _exchange(port, GET)
        status, err = _status_and_error(reply)
        assert status == 503 and err["message"] == \
            "the server has 2 connections open, its limit (--max-connections): try again later"
        for s in held:  # those within the cap are served, and kept alive
            s.sendall(GET)
            assert s.recv(65536).startswith(b"HTTP/1.1 200")
        held.pop().close()
        deadline = time.monotonic() + 10
        while not _exchange(port, GET.replace(b"Host: x", b"Host: x\r\nConnection: close"))[0].startswith(
                b"HTTP/1.1 200"):  # a freed place is taken again
            assert time.monotonic() < deadline
            time.sleep(0.05)
        held[0].close()
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("flag, value, says", [("--max-connections", "0", "expected a whole number >= 1"),
                                               ("--header-timeout-s", "0", "expected seconds > 0"),
                                               ("--header-timeout-s", "soon", "expected seconds >= 0")])
def test_bad_connection_limits_are_argument_errors(capsys, flag, value, says):
    from eagle_jax.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", flag, value])
    assert e.value.code == 2
    assert f"argument {flag}: {says}, got '{value}'" in capsys.readouterr().err


# ---------------------------------------------------------------------------- uvicorn's members


def test_the_uvicorn_members_the_protocol_relies_on():
    """eagle_jax.serve.app._H11 subclasses uvicorn's H11Protocol and relies on what its docstring
    lists; these checks fail on an upgrade that changes any of it (the tests above check the
    behaviour)."""
    for name in ("connection_made", "data_received", "connection_lost", "eof_received", "on_response_complete",
                 "send_400_response"):
        assert callable(getattr(H11Protocol, name, None)), name
    init = inspect.getsource(H11Protocol.__init__)
    assert "self.conn = h11.Connection(" in init and "self.app = config.loaded_app" in init
    assert "self.config = config" in init and "self.cycle" in init
    assert "self.connections = server_state.connections" in init and "self.loop = " in init
    events = inspect.getsource(H11Protocol.handle_events)
    assert "self.send_400_response(" in events  # a parse error is answered there
    assert "app = self.app" in events and "conn=self.conn" in events  # read at each request
    assert "self.scope = scope" in inspect.getsource(RequestResponseCycle.__init__)
    made = inspect.getsource(H11Protocol.connection_made)
    assert "self.connections.add(self)" in made and "self.transport = transport" in made

