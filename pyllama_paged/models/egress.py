"""Where a pull may connect. A model name may carry a host, and a pull is started by any API
client, so the server must not become a way into the network it sits in:

- hosts: the configured Ollama registry, the Hugging Face Hub (hf.co, huggingface.co and
  HF_ENDPOINT) and the operator's additions (PULL_ALLOW_ENV, `--pull-allow`); others are refused;
- addresses: each name is resolved here and every address must be a public one, unless the host
  was named explicitly (the configured registry, HF_ENDPOINT, an addition); the connection then
  goes to the address that was checked, so a second DNS answer cannot move it;
- redirects: https only (plain http only back to the very origin the operator configured), and
  only to the source's known blob hosts (BLOB_HOSTS_ENV) or the hosts above.

Failures to connect say "cannot reach HOST" and nothing more: which port is open, closed or not
TLS is not the client's business."""

from __future__ import annotations

import http.client
import ipaddress
import os
import socket
import ssl
import time
from urllib.parse import urljoin, urlsplit

from ..errors import DownloadError, RequestError
from .refs import DEFAULT_REGISTRY, HF_HOSTS, REGISTRY_ENV, registry_base

PULL_ALLOW_ENV = "PYLLAMA_PAGED_PULL_ALLOW"
# the option naming those hosts (serve's and pull's --pull-allow), as its help says it
PULL_ALLOW_HELP = ("hosts pulls may use besides the configured registry (PYLLAMA_PAGED_REGISTRY) and the Hugging "
                   "Face Hub, comma-separated (also PYLLAMA_PAGED_PULL_ALLOW); a host named here may be on a "
                   "private or loopback address (docs/models.md)")
BLOB_HOSTS_ENV = "PYLLAMA_PAGED_BLOB_HOSTS"
HUB_ENDPOINT_ENV = "HF_ENDPOINT"
# where the Ollama registry and the Hub send blobs (a leading dot: that domain's subdomains)
DEFAULT_BLOB_HOSTS = (".r2.cloudflarestorage.com", ".hf.co", ".huggingface.co")
MAX_REDIRECTS = 5
_REDIRECTS = (301, 302, 303, 307, 308)
_DEFAULT_PORTS = {"http": 80, "https": 443}


class Unreachable(DownloadError):
    """No connection to a host (refused, timed out, not TLS, not HTTP): nothing more is said."""


def _split(hostport: str, scheme: str = "https") -> tuple[str, int]:
    """(host, port) of a host[:port] (lower case; an IPv6 literal without its brackets)."""
    parts = urlsplit(f"//{hostport.strip()}")
    try:
        port = parts.port
    except ValueError:
        raise RequestError(f"{hostport!r} is not a HOST[:PORT]") from None
    return (parts.hostname or "").lower(), port or _DEFAULT_PORTS.get(scheme, 443)


def _entries(text: str | None) -> list[str]:
    return [e.strip().lower() for e in (text or "").split(",") if e.strip()]


def operator_hosts() -> list[str]:
    """The hosts the operator added (PULL_ALLOW_ENV, comma-separated HOST[:PORT])."""
    return _entries(os.environ.get(PULL_ALLOW_ENV))


def _origin(url: str) -> tuple[str, str, int]:
    parts = urlsplit(url)
    host, port = _split(parts.netloc, parts.scheme)
    return parts.scheme, host, port


def explicit_origins() -> list[tuple[str, str, int]]:
    """(scheme, host, port) the operator named: the registry, HF_ENDPOINT if set, the additions
    (which may be on private addresses, and the first two on plain http)."""
    origins = [_origin(registry_base())] if os.environ.get(REGISTRY_ENV) else []
    if os.environ.get(HUB_ENDPOINT_ENV):
        origins.append(_origin(os.environ[HUB_ENDPOINT_ENV].strip().rstrip("/")))
    for entry in operator_hosts():
        origins += [("https", *_split(entry, "https"))]
        if ":" not in entry.rsplit("]", 1)[-1]:   # a host without a port: either default port
            origins.append(("http", *_split(entry, "http")))
    return origins


def _matches(host: str, port: int, entry: str) -> bool:
    """Whether host:port is an entry of a host list ('.example.com': its subdomains)."""
    if entry.startswith("."):
        return host.endswith(entry) and port == 443
    e_host, e_port = _split(entry)
    return host == e_host and (port == e_port or ":" not in entry.rsplit("]", 1)[-1] and port in (80, 443))


def _explicit(host: str, port: int) -> bool:
    return any(host == h and port == p for _, h, p in explicit_origins())


def source_allowed(host: str, port: int) -> bool:
    """Whether a pull may start at host:port (a registry named in a model reference)."""
    default_registry = _split(urlsplit(DEFAULT_REGISTRY).netloc)
    configured = bool(os.environ.get(REGISTRY_ENV))
    hub = [_split(h) for h in HF_HOSTS]
    return (_explicit(host, port) or (host, port) in hub
            or (not configured and (host, port) == default_registry))


def check_registry_host(hostport: str) -> None:
    """RequestError unless a pull may use the registry a name carries."""
    host, port = _split(hostport)
    if not source_allowed(host, port):
        raise RequestError(f"pulls from {hostport} are not allowed: this server pulls from its configured "
                           f"registry ({REGISTRY_ENV}) and the Hugging Face Hub; an operator adds other hosts "
                           f"with --pull-allow HOST[:PORT] or {PULL_ALLOW_ENV}")


def blob_hosts() -> list[str]:
    """Where a source may redirect a download to (BLOB_HOSTS_ENV replaces the defaults)."""
    configured = os.environ.get(BLOB_HOSTS_ENV)
    return _entries(configured) if configured is not None else list(DEFAULT_BLOB_HOSTS)


def redirect_allowed(start: str, target: str) -> bool:
    """Whether a download that started at start may follow a redirect to target."""
    scheme, host, port = _origin(target)
    if scheme == "http":
        # plain http only back to the very origin the operator configured on http
        return (scheme, host, port) == _origin(start) and (scheme, host, port) in explicit_origins()
    if scheme != "https":
        return False
    if source_allowed(host, port):
        return True
    return any(_matches(host, port, entry) for entry in blob_hosts() + operator_hosts())


# IPv6 forms that carry an IPv4 address in their last 32 bits: NAT64's well-known prefix
# (RFC 6052), IPv4-translated (RFC 2765) and IPv4-compatible (deprecated, RFC 4291) addresses
_IPV4_IN_LAST_32 = tuple(ipaddress.ip_network(n) for n in ("64:ff9b::/96", "::ffff:0:0:0/96", "::/96"))
# NAT64's local-use prefix (RFC 8215): its IPv4 part sits where the operator chose, and it
# reaches whatever the operator's translator reaches: never public
_LOCAL_NAT64 = ipaddress.ip_network("64:ff9b:1::/48")
_GLOBAL_UNICAST = ipaddress.ip_network("2000::/3")


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 form wraps (mapped, 6to4, Teredo, NAT64, translated or compatible)."""
    inner = ip.ipv4_mapped or ip.sixtofour or (ip.teredo[1] if ip.teredo else None)
    if inner is None and int(ip) > 1 and any(ip in net for net in _IPV4_IN_LAST_32):   # :: and ::1 are not
        inner = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return inner


def _public(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """A global unicast address; what an IPv6 form wraps is judged as the IPv4 address it is."""
    if ip.version == 6:
        if ip in _LOCAL_NAT64:
            return False
        inner = _embedded_ipv4(ip)
        if inner is not None:
            return _public(inner)
        if ip not in _GLOBAL_UNICAST:
            return False
    return ip.is_global and not ip.is_multicast


def checked_addresses(host: str, port: int, deadline: float | None = None) -> list[str]:
    """The addresses of host a pull may connect to: all of them public, or the host explicit.
    RequestError when some is not (one private answer is enough to refuse)."""
    try:
        literal = ipaddress.ip_address(host)
    except ValueError:
        literal = None
    if literal is not None:
        found = [literal]
    else:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            raise Unreachable(f"cannot reach {host}") from None
        found = list(dict.fromkeys(ipaddress.ip_address(info[4][0].split("%", 1)[0]) for info in infos))
    if deadline is not None and time.monotonic() > deadline:
        raise Unreachable(f"cannot reach {host} (time ran out)")
    if not _explicit(host, port) and not all(_public(ip) for ip in found):
        raise RequestError(f"{host} resolves to an address that is not public (loopback, private, link-local or "
                           f"reserved); pulls from it must be allowed with --pull-allow {host} or {PULL_ALLOW_ENV}")
    return [str(ip) for ip in found]


class _Connection(http.client.HTTPConnection):
    """Plain HTTP to the checked address (the Host header keeps the name)."""

    def __init__(self, host: str, port: int, address: str, timeout: float):
        super().__init__(host, port, timeout=timeout)
        self.address = address

    def connect(self) -> None:
        self.sock = socket.create_connection((self.address, self.port), self.timeout)


class _TLSConnection(http.client.HTTPSConnection):
    """TLS to the checked address, its certificate checked against the name."""

    def __init__(self, host: str, port: int, address: str, timeout: float):
        self.tls = ssl.create_default_context()
        super().__init__(host, port, timeout=timeout, context=self.tls)
        self.address = address

    def connect(self) -> None:
        raw = socket.create_connection((self.address, self.port), self.timeout)
        try:
            self.sock = self.tls.wrap_socket(raw, server_hostname=self.host)
        except BaseException:
            raw.close()
            raise


class Reply:
    """An HTTP response and its connection (closed together)."""

    def __init__(self, connection: http.client.HTTPConnection, response: http.client.HTTPResponse, host: str,
                 deadline: float | None, timeout: float):
        self.connection, self.response, self.host = connection, response, host
        self.deadline, self.timeout = deadline, timeout
        self.status, self.headers = response.status, response.headers

    def read(self, n: int) -> bytes:
        """Up to n bytes as they arrive (one receive at most), each wait bounded by the
        socket timeout and by what is left of the deadline."""
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the deadline passed")
            if self.connection.sock is not None:
                self.connection.sock.settimeout(min(self.timeout, left))
        return self.response.read1(n)

    def close(self) -> None:
        self.response.close()
        self.connection.close()

    def __enter__(self) -> "Reply":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _connect(url: str, headers: dict[str, str], timeout: float, deadline: float | None) -> Reply:
    parts = urlsplit(url)
    host, port = _split(parts.netloc, parts.scheme)
    addresses = checked_addresses(host, port, deadline)
    kind = _TLSConnection if parts.scheme == "https" else _Connection
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    for address in addresses:
        connection = kind(host, port, address, min(timeout, max(0.1, deadline - time.monotonic()))
                          if deadline is not None else timeout)
        try:
            connection.request("GET", path, headers=headers)
            return Reply(connection, connection.getresponse(), host, deadline, timeout)
        except (OSError, http.client.HTTPException, ValueError):
            connection.close()
    raise Unreachable(f"cannot reach {host}")


def open_url(url: str, headers: dict[str, str], timeout: float, deadline: float | None = None) -> Reply:
    """GET url, following allowed redirects; the caller checked url's own host. Unreachable,
    RequestError (an address that is not allowed) or DownloadError (a redirect that is not)."""
    current = url
    for _ in range(MAX_REDIRECTS + 1):
        if urlsplit(current).scheme not in _DEFAULT_PORTS:
            raise DownloadError(f"{_origin(url)[1]} redirected a download to a scheme other than https")
        reply = _connect(current, headers, timeout, deadline)
        location = reply.headers.get("Location")
        if reply.status not in _REDIRECTS or not location:
            return reply
        reply.close()
        target = urljoin(current, location)
        if not redirect_allowed(url, target):
            raise DownloadError(f"{_origin(url)[1]} redirected a download outside the hosts pulls may use "
                                f"(https to the source's blob hosts, {BLOB_HOSTS_ENV}); it was not followed")
        current = target
    raise DownloadError(f"{_origin(url)[1]} redirected more than {MAX_REDIRECTS} times")


def check_url(url: str, start: str | None = None) -> None:
    """For a client that connects by itself (the Hub's): refuse a URL outside the allowed hosts,
    or whose name resolves where it may not (checked here; the client resolves again)."""
    scheme, host, port = _origin(url)
    allowed = redirect_allowed(start or url, url) if start else (
        (scheme == "https" or (scheme, host, port) in explicit_origins()) and
        (source_allowed(host, port) or any(_matches(host, port, e) for e in blob_hosts() + operator_hosts())))
    if not allowed:
        raise RequestError(f"a pull may not connect to {host} (not an allowed host over https; "
                           f"see --pull-allow and {BLOB_HOSTS_ENV})")
    checked_addresses(host, port)
