"""Host and Origin checks for `localllm serve`: a web page the user visits must not drive the server.

Two browser attacks reach a server on 127.0.0.1 that has no API key:
- DNS rebinding: a page on attacker.example re-points that name at 127.0.0.1 and then talks to
  the server "same-origin"; every request carries `Host: attacker.example`. Refused unless the
  Host is a name this machine answers to (localhost, *.localhost, its hostname, the --host it
  is bound to, the names given with --allow-host) or an IP address (a rebinding needs a DNS name:
  a browser that sends an IP as Host connected to that IP on purpose).
- cross-site requests: a page on attacker.example posts to http://127.0.0.1:8000 (Host is fine);
  the browser adds `Origin: http://attacker.example`. Refused unless the Origin is a loopback
  page (http(s)://localhost, 127.x.x.x, [::1], 0.0.0.0, any port), a page on one of the trusted
  names above, a local app (app://, file://, tauri://, vscode-webview://, vscode-file://, as
  Ollama allows them) or one of the --cors-origin values ('*': any). A request without Origin
  (curl, SDKs, server-side front ends) is never refused for it.

As Ollama does (OLLAMA_HOST/OLLAMA_ORIGINS): the Host check applies when the server listens on a
loopback address; one bound to another address (0.0.0.0, a LAN address) was exposed on purpose and
is reached by names we cannot know (its addresses, a reverse proxy's name, host.docker.internal),
so any Host is accepted there, while the Origin check always applies (the rebinding page's own
posts carry its Origin). Allowing an Origin sends no CORS header: only --cors-origin does that.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Ollama's default allowed origins besides loopback pages: local apps, not web pages
APP_SCHEMES = ("app", "file", "tauri", "vscode-webview", "vscode-file")


def host_name(value: str) -> str | None:
    """The host of a Host header or of an origin's authority, lowercased, without port, brackets
    or a trailing dot ("[::1]:8000" -> "::1", "LocalHost.:80" -> "localhost"); None if malformed."""
    value = value.strip().lower()
    if value.startswith("["):
        host, sep, rest = value[1:].partition("]")
        if not sep or (rest and not (rest.startswith(":") and rest[1:].isdigit())):
            return None
    else:
        host, _, port = value.partition(":")
        if port and not port.isdigit():
            return None
    host = host.removesuffix(".")
    if not host or any(c in host for c in "/@\\ ?#"):
        return None
    return host


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def is_loopback(host: str) -> bool:
    """A --host value that only this machine can reach (what the Host check depends on)."""
    ip = _ip(host.strip("[]"))
    return ip.is_loopback if ip is not None else host.lower() in ("localhost", "localhost.")


@dataclass(frozen=True)
class HostPolicy:
    check_host: bool  # False: any Host (bound beyond loopback, or --allow-host '*')
    names: frozenset[str]  # trusted host names, lowercased
    origins: frozenset[str]  # --cors-origin values (exact origins)
    any_origin: bool  # --cors-origin '*'

    @classmethod
    def make(cls, bind_host: str, allow_hosts: list[str], cors_origins: list[str]) -> HostPolicy:
        names = {"localhost", socket.gethostname().lower()}
        names.add(bind_host.strip().strip("[]").lower().removesuffix("."))
        names.update(h for h in (host_name(a) for a in allow_hosts if a != "*") if h)
        return cls(check_host=is_loopback(bind_host) and "*" not in allow_hosts, names=frozenset(names),
                   origins=frozenset(o.rstrip("/").lower() for o in cors_origins if o != "*"),
                   any_origin="*" in cors_origins)

    def _trusted_name(self, host: str) -> bool:
        return host in self.names or host.endswith(".localhost")

    def host_allowed(self, header: str | None) -> bool:
        if not self.check_host or header is None:  # HTTP/1.0 without Host: not a browser
            return True
        host = host_name(header)
        return host is not None and (self._trusted_name(host) or _ip(host) is not None)

    def origin_allowed(self, origin: str | None) -> bool:
        if origin is None or self.any_origin:
            return True
        origin = origin.strip().rstrip("/").lower()
        if origin in self.origins:
            return True
        scheme, sep, authority = origin.partition("://")
        if not sep:  # "null" (sandboxed frames, file pages) or garbage
            return False
        if scheme in APP_SCHEMES:
            return True
        host = host_name(authority)
        if scheme not in ("http", "https") or host is None:
            return False
        ip = _ip(host)
        return self._trusted_name(host) or (ip is not None and (ip.is_loopback or ip.is_unspecified))


class HostGuardMiddleware:
    """Refuses (403) requests whose Host or Origin `policy` does not allow, before anything else
    runs (auth, CORS, the body). `error_body(scope, APIError)` shapes the answer for the route."""

    def __init__(self, app, policy: HostPolicy, error_body: Callable[[Any, Any], dict],
                 on_reject: Callable[[], None] = lambda: None):
        self.app, self.policy, self.error_body, self.on_reject = app, policy, error_body, on_reject

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode(): v.decode("latin-1") for k, v in scope["headers"] if k in (b"host", b"origin")}
        host, origin = headers.get("host"), headers.get("origin")
        if not self.policy.host_allowed(host):
            message = (f"Host {host!r} is not allowed (DNS rebinding protection): this server answers to "
                       f"localhost and its own names; start it with --allow-host {host_name(host) or 'NAME'} "
                       "to accept this one")
            code = "host_not_allowed"
        elif not self.policy.origin_allowed(origin):
            message = (f"Origin {origin!r} is not allowed: web pages other than local ones may not use this "
                       f"server; start it with --cors-origin {origin} to allow that page")
            code = "origin_not_allowed"
        else:
            return await self.app(scope, receive, send)
        from fastapi.responses import JSONResponse

        from .openai_schema import APIError

        self.on_reject()
        err = APIError(403, message, "permission_error", code=code)
        await JSONResponse(self.error_body(scope, err), status_code=403)(scope, receive, send)
