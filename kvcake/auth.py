"""Cluster secret and the mutual HMAC challenge-response every internal connection opens with.

Whoever holds the secret may use the cluster's internal ports (store RPC, segment servers, worker
links); whoever does not is refused before a single request is read. The exchange, right after
TCP connect and before the protocol's first byte (HMAC-SHA256 from `hmac`, nonces from
`secrets`; the secret never crosses the wire):

    server -> client   HELLO  (16-byte magic) | server nonce (32)
    client -> server   ANSWER (16-byte magic) | client nonce (32) | HMAC(k, "client", ctx, nonces)
    server -> client   0x00 | HMAC(k, "server", ctx, nonces)     accepted; the client checks it
                     | 0x01, then close                           refused (logged by the server)

`ctx` names the protocol (`STORE_RPC`, `SEGMENT`, `WORKER`), so an answer for one service is no
answer for another; fresh nonces on both sides make a recorded exchange useless. Comparisons are
constant-time (`hmac.compare_digest`). A client without a secret that reaches a server that needs
one reads HELLO where it expected a reply: `is_hello` lets its protocol say so clearly.

Use (a server, after accept, before reading a request; a client, after connect):

    secret = ClusterSecret.load(file=cfg.secret_file, env=cfg.secret_env)  # None: no auth
    if not admit(conn, secret, WORKER, log):   # server: False = refused, logged; close conn
        conn.close(); return
    authenticate(sock, secret, WORKER)           # client: AuthError if either side is wrong

Both are no-ops when `secret` is None (today's open ports). The cost is one extra round trip
per connection, never per request.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import socket
import stat
from hashlib import sha256
from pathlib import Path

HELLO_MAGIC = b"KVCAKE-AUTH-HI1\n"
ANSWER_MAGIC = b"KVCAKE-AUTH-AN1\n"
NONCE_BYTES = 32
MAC_BYTES = 32  # SHA-256
HELLO_BYTES = len(HELLO_MAGIC) + NONCE_BYTES  # 48: longer than a segment reply header (44)
ANSWER_BYTES = len(ANSWER_MAGIC) + NONCE_BYTES + MAC_BYTES
MIN_SECRET_BYTES = 16
ENV_VAR = "KVCAKE_CLUSTER_SECRET"  # the name `kvcake serve` hands its workers the secret under
HANDSHAKE_TIMEOUT_S = 10.0

# Protocol contexts: an answer proves the secret for one protocol only.
STORE_RPC = b"kvcake/store-rpc/1"
SEGMENT = b"kvcake/segment/1"
WORKER = b"kvcake/worker/1"

_ACCEPTED, _REFUSED = b"\x00", b"\x01"


class AuthError(PermissionError):
    """The other side failed the cluster-secret challenge, or refused ours. A PermissionError
    (an OSError): code that treats a failed connect as an OSError handles it unchanged."""


class ClusterSecret:
    """A shared key of at least MIN_SECRET_BYTES bytes. Its repr never shows it."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        if not isinstance(key, bytes) or len(key) < MIN_SECRET_BYTES:
            raise ValueError(f"cluster secret: need at least {MIN_SECRET_BYTES} bytes, got "
                             f"{len(key) if isinstance(key, bytes) else type(key).__name__}; "
                             "make one with `python -c 'import secrets; "
                             "print(secrets.token_hex(32))'`")
        self._key = key

    @classmethod
    def generate(cls) -> ClusterSecret:
        """A fresh random secret (32 bytes, as 64 hex characters)."""
        return cls(secrets.token_hex(32).encode("ascii"))

    @classmethod
    def from_text(cls, text: str, where: str = "cluster secret") -> ClusterSecret:
        """The secret is the text itself, surrounding whitespace removed."""
        key = text.strip().encode("utf-8")
        if len(key) < MIN_SECRET_BYTES:
            raise ValueError(f"{where}: the secret must be at least {MIN_SECRET_BYTES} "
                             f"characters, got {len(key)}")
        return cls(key)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> ClusterSecret:
        """Read the secret from a file (its text; `write` makes one). ValueError if it is
        missing, too short, or readable by other users."""
        p = Path(path)
        try:
            mode = p.stat().st_mode
            text = p.read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"cluster secret file {str(p)!r}: {exc.strerror or exc}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ValueError(f"cluster secret file {str(p)!r} is readable by other users: "
                             f"run `chmod 600 {p}`")
        return cls.from_text(text, f"cluster secret file {str(p)!r}")

    @classmethod
    def from_env(cls, name: str = ENV_VAR) -> ClusterSecret:
        """Read the secret from environment variable `name`; ValueError if unset or too short."""
        value = os.environ.get(name)
        if value is None:
            raise ValueError(f"cluster secret: environment variable {name} is not set")
        return cls.from_text(value, f"cluster secret in ${name}")

    @classmethod
    def load(cls, file: str | None = None, env: str | None = None) -> ClusterSecret | None:
        """The secret from `file` or from environment variable `env` (at most one); None when
        neither is given (no authentication)."""
        if file and env:
            raise ValueError("cluster secret: give a secret file or an environment variable "
                             "name, not both")
        if file:
            return cls.from_file(file)
        if env:
            return cls.from_env(env)
        return None

    def write(self, path: str | os.PathLike[str]) -> None:
        """Write the secret to a new file readable by its owner only."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(self._key + b"\n")

    def text(self) -> str:
        """The secret as text, to hand to a child process (e.g. in ENV_VAR). Keep it private."""
        return self._key.decode("utf-8")

    def mac(self, role: bytes, context: bytes, server_nonce: bytes, client_nonce: bytes
            ) -> bytes:
        message = b"".join((role, b"\0", len(context).to_bytes(2, "big"), context,
                            server_nonce, client_nonce))
        return hmac.new(self._key, message, sha256).digest()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ClusterSecret) and hmac.compare_digest(self._key, other._key)

    def __hash__(self) -> int:
        return hash(sha256(self._key).digest())

    def __repr__(self) -> str:
        return "ClusterSecret(<hidden>)"


def is_hello(data: bytes | bytearray | memoryview) -> bool:
    """Whether `data` starts like a server's HELLO (a client without a secret reads it)."""
    prefix = bytes(data[:len(HELLO_MAGIC)])
    return len(prefix) >= 4 and HELLO_MAGIC.startswith(prefix)


def serve_handshake(sock: socket.socket, secret: ClusterSecret, context: bytes,
                    timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
    """Server side: challenge the peer; AuthError (after telling it, where it answered at all)
    if it does not prove `secret`. OSError if the connection fails. The caller closes on error."""
    with _timeout(sock, timeout_s):
        server_nonce = secrets.token_bytes(NONCE_BYTES)
        sock.sendall(HELLO_MAGIC + server_nonce)
        answer = _recv(sock, ANSWER_BYTES, "the client's answer")
        if not hmac.compare_digest(answer[:len(ANSWER_MAGIC)], ANSWER_MAGIC):
            raise AuthError("the client did not answer the cluster-secret challenge (it has "
                            "no secret configured, or speaks another protocol)")
        client_nonce = answer[len(ANSWER_MAGIC):len(ANSWER_MAGIC) + NONCE_BYTES]
        proof = answer[len(ANSWER_MAGIC) + NONCE_BYTES:]
        if not hmac.compare_digest(proof, secret.mac(b"client", context, server_nonce,
                                                     client_nonce)):
            _try_send(sock, _REFUSED)
            raise AuthError("the client's answer does not prove the cluster secret (wrong "
                            "secret?)")
        sock.sendall(_ACCEPTED + secret.mac(b"server", context, server_nonce, client_nonce))


def authenticate(sock: socket.socket, secret: ClusterSecret | None, context: bytes,
                 timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
    """Client side, right after connect: answer the server's challenge and check its proof.
    No-op when `secret` is None. AuthError if either side fails; OSError if the link does."""
    if secret is None:
        return
    with _timeout(sock, timeout_s):
        hello = _recv(sock, HELLO_BYTES, "the server's challenge")
        if not hmac.compare_digest(hello[:len(HELLO_MAGIC)], HELLO_MAGIC):
            raise AuthError("the server sent no cluster-secret challenge: it runs without a "
                            "secret (configure the same secret on both sides), or is not a "
                            "kvcake server")
        server_nonce = hello[len(HELLO_MAGIC):]
        client_nonce = secrets.token_bytes(NONCE_BYTES)
        sock.sendall(ANSWER_MAGIC + client_nonce
                     + secret.mac(b"client", context, server_nonce, client_nonce))
        verdict = _recv(sock, 1, "the server's verdict", refused_on_eof=True)
        if verdict != _ACCEPTED:
            raise AuthError("the server refused this connection: wrong cluster secret")
        proof = _recv(sock, MAC_BYTES, "the server's proof")
        if not hmac.compare_digest(proof, secret.mac(b"server", context, server_nonce,
                                                     client_nonce)):
            raise AuthError("the server does not hold the cluster secret: refusing to use it")


def admit(sock: socket.socket, secret: ClusterSecret | None, context: bytes,
          log: logging.Logger, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> bool:
    """Server side, right after accept: True if the peer may go on (always, without a secret);
    False if it failed the challenge (logged with its address; the caller closes the socket)."""
    if secret is None:
        return True
    try:
        serve_handshake(sock, secret, context, timeout_s)
        return True
    except (AuthError, OSError) as exc:
        log.warning("refused a %s connection from %s: %s", context.decode(), _peer(sock), exc)
        return False


class _timeout:
    """Python-level timeout on `sock` for the handshake, then the socket's own mode back."""

    def __init__(self, sock: socket.socket, timeout_s: float) -> None:
        self._sock, self._timeout_s = sock, timeout_s

    def __enter__(self) -> None:
        self._before = self._sock.gettimeout()
        self._sock.settimeout(self._timeout_s)

    def __exit__(self, *exc: object) -> None:
        try:
            self._sock.settimeout(self._before)
        except OSError:
            pass


def _recv(sock: socket.socket, num_bytes: int, what: str, refused_on_eof: bool = False
          ) -> bytes:
    buf = bytearray()
    while len(buf) < num_bytes:
        chunk = sock.recv(num_bytes - len(buf))
        if not chunk:
            if refused_on_eof:
                raise AuthError("the server closed the connection during the cluster-secret "
                                "challenge: it refused this client (wrong secret?)")
            raise AuthError(f"connection closed while waiting for {what} "
                            f"({len(buf)} of {num_bytes} bytes)")
        buf += chunk
    return bytes(buf)


def _try_send(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:
        pass


def _peer(sock: socket.socket) -> str:
    try:
        name = sock.getpeername()
    except OSError:
        return "a closed socket"
    if isinstance(name, tuple) and len(name) >= 2:
        return f"{name[0]}:{name[1]}"
    return repr(name) if name else "a local socket"
