"""CURVE authentication and encryption for the learner's sockets.

Rule: every socket bound to (or connected to) a non-loopback address uses CURVE: the
learner's sockets are CURVE servers with the learner's keypair, a ZAP authenticator thread
in the learner process admits only client public keys found in the allowed directory, and
every generator proves its own keypair and pins the learner's public key. Loopback
(127.0.0.0/8, ::1, localhost), ipc:// and inproc:// endpoints use CURVE only when
``curve_on_loopback`` is set (both sides must agree). Binding a non-loopback address
without keys raises :class:`InsecureBindError` unless ``insecure=True`` is passed (the
learner's config keys: ``endpoints.keys=DIR`` for CURVE, ``endpoints.insecure=true`` for the
opt-out; its message names them).

Key directory (written by ``looprl keys DIR``, see pipeline.commands.keys_cli)::

    DIR/learner.key                  learner public key  (copy to every generator host)
    DIR/learner.key_secret           learner keypair     (learner host only)
    DIR/allowed/<name>.key           generator public keys the learner admits
    DIR/generators/<name>.key_secret generator keypair   (that generator's host only)

A client key is an identity: its file name ``<name>`` is the generator id it speaks for.
The ZAP authenticator answers a handshake with User-Id = ``<name>``, and the learner's
endpoint accepts a frame only when its routing id claims a generator id that name owns
(:func:`owns`: ``<name>`` itself or ``<name>:<suffix>``, so one keypair shared by the
replicas of a Deployment still gives each its own id). Everything else is refused, counted
(``TransportStats.wrong_identity``) and dropped without an answer.

Rejected handshakes never reach the application: the transport counts them from socket
monitor events (``TransportStats.unauthenticated``) and keeps serving everyone else.
"""

from __future__ import annotations

import ipaddress
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

log = logging.getLogger(__name__)

LEARNER_NAME = "learner"
ALLOWED_DIR = "allowed"
GENERATORS_DIR = "generators"
ZAP_DOMAIN = "looprl"
ID_SEP = ":"  # NAME:SUFFIX is a generator id that the key NAME speaks for
MAX_KEY_NAME = 200  # bytes; leaves room for a suffix within the 246-byte generator id
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*$")


class SecurityError(ValueError):
    """Keys are missing or unusable, or a socket would be exposed without them."""


class InsecureBindError(SecurityError):
    """A non-loopback address would be bound without CURVE keys."""


def generator_keys(keys_dir: str | Path) -> list[str]:
    """Generator keypair names in KEYS/generators (written by `looprl keys KEYS -n N`)."""
    secrets = (Path(keys_dir) / GENERATORS_DIR).glob("*.key_secret")
    return sorted(p.name.removesuffix(".key_secret") for p in secrets)


def endpoint_host(endpoint: str) -> str | None:
    """The host part of a tcp:// endpoint ("*" for all interfaces); None for ipc/inproc."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        raise SecurityError(f"endpoint {endpoint!r} has no transport (e.g. tcp://127.0.0.1:5555)")
    if scheme in ("ipc", "inproc"):
        return None
    if scheme != "tcp":
        raise SecurityError(
            f"endpoint {endpoint!r}: only tcp://, ipc:// and inproc:// are supported"
        )
    hostport = rest.split(";")[-1]  # "source;dest" form of connect endpoints
    host = hostport.rsplit(":", 1)[0] if ":" in hostport else hostport
    return host.strip("[]")


def is_loopback(endpoint: str) -> bool:
    """True when ``endpoint`` only reaches this host (loopback tcp, ipc, inproc)."""
    host = endpoint_host(endpoint)
    if host is None or host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "*", an interface name or a host name: reachable from elsewhere
        return False


def check_key_name(name: str) -> str:
    """``name`` if it can name a client key (and so a generator id); SecurityError otherwise."""
    if not _NAME.match(name) or len(name.encode()) > MAX_KEY_NAME or name == LEARNER_NAME:
        raise SecurityError(
            f"key name {name!r}: expected letters, digits, '.', '_' or '-' (at most "
            f"{MAX_KEY_NAME} bytes, not starting with a symbol, not {LEARNER_NAME!r})"
        )
    return name


def owns(key_name: str, generator_id: str) -> bool:
    """Whether the client key ``key_name`` may speak for ``generator_id``."""
    return generator_id == key_name or generator_id.startswith(key_name + ID_SEP)


def generator_id_for(key_name: str, wanted: str = "") -> str:
    """The generator id a client holding key ``key_name`` uses: ``wanted`` if that key owns
    it, the key name if ``wanted`` is empty, else ``<key_name>:<wanted>``."""
    if not wanted or owns(key_name, wanted):
        return wanted or key_name
    return f"{key_name}{ID_SEP}{wanted}"


def load_allowed(allowed_dir: Path) -> dict[bytes, str]:
    """z85 public key -> key name for every ``*.key`` in ``allowed_dir`` (SecurityError for
    an unusable name or one public key under two names: its identity would be ambiguous)."""
    names: dict[bytes, str] = {}
    for f in sorted(Path(allowed_dir).glob("*.key")):
        name = check_key_name(f.name.removesuffix(".key"))
        public, _ = zmq.auth.load_certificate(f)
        if public in names:
            raise SecurityError(
                f"{f} and {allowed_dir}/{names[public]}.key hold the same public key: a key "
                "must name exactly one generator identity (remove one of them)"
            )
        names[public] = name
    return names


class _Authenticator(ThreadAuthenticator):
    """ZAP handler: admits the public keys of ``allowed`` and answers User-Id = key name.

    With ``allowed_dir``, a key it does not know makes it read the directory again when the
    directory changed since it last did (keys added with ``looprl keys DIR --add`` while the
    learner runs: a generator array job that joins late); an unknown key alone costs one
    stat of the directory."""

    def __init__(self, context: zmq.Context, allowed_dir: Path | None = None) -> None:
        super().__init__(context, log=log.getChild("zap"))
        self.allowed: dict[bytes, str] = {}  # replaced whole on reload: safe across threads
        self.allowed_dir = allowed_dir
        self._seen = self._stamp()

    def _stamp(self) -> tuple[int, int]:
        if self.allowed_dir is None:
            return (0, 0)
        try:
            st = self.allowed_dir.stat()
        except OSError:
            return (0, 0)
        return (st.st_mtime_ns, st.st_ino)

    def callback(self, domain: str, key: bytes) -> bool:  # credentials provider, z85 key
        if key not in self.allowed and self.allowed_dir is not None:
            stamp = self._stamp()
            if stamp != self._seen:
                self._seen = stamp
                try:
                    self.allowed = load_allowed(self.allowed_dir)
                    log.info("CURVE: %d generator keys in %s (re-read: it changed)",
                             len(self.allowed), self.allowed_dir)  # fmt: skip
                except (SecurityError, OSError, ValueError) as e:  # keep the keys it had
                    log.warning("CURVE: %s changed but cannot be read (%s); keeping the %d "
                                "keys loaded before", self.allowed_dir, e, len(self.allowed))  # fmt: skip
        return key in self.allowed

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self.allowed.get(z85.encode(client_public_key), "")  # "" owns no id


def _load_keypair(path: Path) -> tuple[bytes, bytes]:
    if not path.is_file():
        raise SecurityError(
            f"CURVE secret key file {path} not found (create keys: looprl keys DIR)"
        )
    public, secret = zmq.auth.load_certificate(path)
    if not secret:
        raise SecurityError(f"{path} holds no secret key (expected a .key_secret file)")
    return public, secret


def _load_public(path: Path) -> bytes:
    if not path.is_file():
        raise SecurityError(
            f"CURVE public key file {path} not found (create keys: looprl keys DIR)"
        )
    public, _ = zmq.auth.load_certificate(path)
    return public


class ServerCurve:
    """Learner side: CURVE server keys plus the ZAP authenticator.

    Order of calls: ``ServerCurve.from_dir(DIR)`` -> ``wants(endpoint)`` per socket ->
    ``start(context)`` once before binding -> ``apply(socket)`` on each socket that wants
    it -> ``stop()`` before the context ends. Generator keys added to the allowed directory
    while it runs are admitted (the authenticator re-reads a changed directory; ``reload()``
    does it at once).
    """

    def __init__(self, secret_file: Path, allowed_dir: Path, *, curve_on_loopback: bool = False):
        self.public_key, self.secret_key = _load_keypair(Path(secret_file))
        self.allowed_dir = Path(allowed_dir)
        if not self.allowed_dir.is_dir():
            raise SecurityError(f"allowed client key directory {self.allowed_dir} not found")
        self.allowed = load_allowed(self.allowed_dir)  # checked now: a bad name fails at start
        if not self.allowed:
            log.warning("no client public keys in %s: every generator will be refused", allowed_dir)
        self.curve_on_loopback = curve_on_loopback
        self._auth: _Authenticator | None = None

    @classmethod
    def from_dir(cls, keys_dir: str | Path, *, curve_on_loopback: bool = False) -> ServerCurve:
        d = Path(keys_dir)
        return cls(
            d / f"{LEARNER_NAME}.key_secret", d / ALLOWED_DIR, curve_on_loopback=curve_on_loopback
        )

    def wants(self, endpoint: str) -> bool:
        return self.curve_on_loopback or not is_loopback(endpoint)

    def start(self, context: zmq.Context) -> None:
        if self._auth is not None:
            return
        self._auth = _Authenticator(context, self.allowed_dir)
        self._auth.start()
        self._auth.allowed = self.allowed
        self._auth.configure_curve_callback(ZAP_DOMAIN, self._auth)

    def reload(self) -> None:
        """Re-read the allowed directory (e.g. after ``looprl keys DIR --add``)."""
        if self._auth is None:
            raise SecurityError("ServerCurve.reload() before start()")
        self.allowed = self._auth.allowed = load_allowed(self.allowed_dir)

    def apply(self, sock: zmq.Socket) -> None:
        if self._auth is None:
            raise SecurityError("ServerCurve.apply() before start(): no authenticator is running")
        sock.curve_secretkey = self.secret_key
        sock.curve_publickey = self.public_key
        sock.curve_server = True
        sock.zap_domain = ZAP_DOMAIN.encode()

    def stop(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


@dataclass
class ClientCurve:
    """Generator side: its own keypair and the learner's public key (pinned). ``name`` is
    the key's name, i.e. the identity the learner binds it to ("": not known here)."""

    server_public_key: bytes
    public_key: bytes
    secret_key: bytes
    curve_on_loopback: bool = False
    name: str = ""

    @classmethod
    def from_files(
        cls, learner_public: str | Path, secret_file: str | Path, *, curve_on_loopback: bool = False
    ) -> ClientCurve:
        public, secret = _load_keypair(Path(secret_file))
        name = Path(secret_file).name.removesuffix(".key_secret")
        return cls(_load_public(Path(learner_public)), public, secret, curve_on_loopback, name)

    @classmethod
    def from_dir(
        cls, keys_dir: str | Path, name: str, *, curve_on_loopback: bool = False
    ) -> ClientCurve:
        d = Path(keys_dir)
        return cls.from_files(
            d / f"{LEARNER_NAME}.key",
            d / GENERATORS_DIR / f"{name}.key_secret",
            curve_on_loopback=curve_on_loopback,
        )

    def wants(self, endpoint: str) -> bool:
        return self.curve_on_loopback or not is_loopback(endpoint)

    def apply(self, sock: zmq.Socket) -> None:
        sock.curve_serverkey = self.server_public_key
        sock.curve_publickey = self.public_key
        sock.curve_secretkey = self.secret_key


def check_bind(endpoint: str, server: ServerCurve | None, *, insecure: bool) -> bool:
    """Whether ``endpoint`` gets CURVE; raise InsecureBindError for an unprotected exposure."""
    if server is not None and server.wants(endpoint):
        return True
    if not is_loopback(endpoint) and not insecure:
        raise InsecureBindError(
            f"refusing to bind {endpoint} (reachable from other hosts) without CURVE keys: "
            "create them with `looprl keys DIR` and set endpoints.keys=DIR (each generator "
            "then connects with `looprl generator --keys DIR`), bind a loopback address "
            "(endpoints.host=127.0.0.1), or set endpoints.insecure=true to accept "
            "unauthenticated, unencrypted traffic"
        )
    if not is_loopback(endpoint):
        log.warning("binding %s WITHOUT authentication or encryption (endpoints.insecure=true)",
                    endpoint)  # fmt: skip
    return False
