"""What the server is set up with before the model loads and before any web framework
is imported: its request limits and its listening socket (a busy port is one line, in a
second)."""

from __future__ import annotations

import socket
from dataclasses import dataclass

__all__ = ["Limits", "PortInUse", "bind"]


@dataclass(frozen=True)
class Limits:
    """What the server accepts: connections, header and body time, body size, token and prompt limits."""
    max_body_bytes: int = 1 << 20
    body_timeout_s: float = 30.0
    max_tokens: int = 4096  # most tokens a request may ask for
    default_max_tokens: int = 128
    max_prompt_tokens: int | None = None  # None: what the context leaves room for
    max_prompts: int = 32  # prompts in one /v1/completions request
    header_timeout_s: float = 10.0  # a request's headers must arrive within this
    max_connections: int = 512  # open connections; one more gets a 503


class PortInUse(OSError):
    """The address cannot be bound."""


def bind(host: str = "127.0.0.1", port: int = 8000) -> socket.socket:
    """A listening socket, or PortInUse with a one-line reason."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise PortInUse(f"cannot listen on {host}:{port}: {e.strerror.lower()}"
                        + (" (another server? pick one with --port)" if port else "")) from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock
