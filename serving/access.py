"""Restricted APIs: groups of endpoints that answer only requests carrying a key in a
header, on every front end (Triton's ``--http-restricted-api`` semantics).

``pxrt serve --restricted-api model-repository:admin-key=SECRET`` lets the inference
port be exposed without exposing model control: a load, unload or index request without
the header ``admin-key: SECRET`` is answered 403 over HTTP and PERMISSION_DENIED over
gRPC (the header is gRPC metadata there), before anything else is looked at. The groups:

- ``health``: live and ready (server and model);
- ``metadata``: server and model metadata, model config;
- ``inference``: infer (and gRPC's stream);
- ``statistics``: model statistics and ``/metrics``;
- ``model-repository``: the repository's index, load and unload;
- ``trace``: the trace settings;
- ``shared-memory``: system shared memory (register, unregister, status), and the use
  of a region by an inference request (``serving.kserve.shm``).

A group is restricted by a key; several groups may share one, and a group may take
several values of its header (the flag repeated: ``shared-memory:shm-key=A`` and
``shared-memory:shm-key=B``), any of which opens it: the ``shared-memory`` group gives
each its own regions (``holder`` says which key a request holds). Keys are compared in
constant time. This is an access key, not a user system: keep the value secret, send it
over TLS, and rotate it by restarting.

TLS (``TlsFiles``): ``--tls-cert`` and ``--tls-key`` serve HTTPS and gRPC over TLS with
one certificate; ``--tls-ca`` makes it mutual (clients must present a certificate those
CAs signed).
"""

from __future__ import annotations

import argparse
import dataclasses
import hmac
import ssl
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from .errors import ServingError
from .options import OptionError

GROUPS = (
    "health", "metadata", "inference", "statistics", "model-repository", "trace",
    "shared-memory",
)  # fmt: skip


class Forbidden(ServingError):
    """A request to a restricted API without its key (HTTP 403, gRPC PERMISSION_DENIED)."""


class KeyRepeated(ServingError):
    """A request that sends a restricted API's key header more than once (HTTP 400, gRPC
    INVALID_ARGUMENT): which one counts would depend on the reader."""


@dataclasses.dataclass(frozen=True)
class Restrictions:
    """Per restricted group: the header (lower case) and the values it may carry (one
    of them: the group's keys)."""

    keys: Mapping[str, tuple[str, tuple[bytes, ...]]] = dataclasses.field(
        default_factory=lambda: MappingProxyType({})
    )

    @classmethod
    def parse(cls, specs: Iterable[str]) -> Restrictions:
        """From ``GROUP[,GROUP...]:HEADER=VALUE`` strings (``--restricted-api``); a group
        given again with its header takes another key."""
        keys: dict[str, tuple[str, tuple[bytes, ...]]] = {}
        for spec in specs:
            groups, sep, key = spec.partition(":")
            header, eq, value = key.partition("=")
            header = header.strip().lower()
            if not sep or not eq or not header or not value or not groups.strip():
                raise OptionError(
                    f"--restricted-api {spec!r}: expected GROUP[,GROUP...]:HEADER=VALUE "
                    f"(groups: {', '.join(GROUPS)})"
                )
            if not header.replace("-", "").replace("_", "").isalnum() or not header.isascii():
                raise OptionError(f"--restricted-api {spec!r}: {header!r} is not a header name")
            for group in (g.strip() for g in groups.split(",")):
                if group not in GROUPS:
                    raise OptionError(
                        f"--restricted-api {spec!r}: no API group {group!r} "
                        f"(groups: {', '.join(GROUPS)})"
                    )
                had, values = keys.get(group, (header, ()))
                if had != header:
                    raise OptionError(
                        f"--restricted-api: group {group!r} is restricted twice, by headers "
                        f"{had!r} and {header!r}: give its keys in one header"
                    )
                if value.encode() not in values:
                    keys[group] = (header, (*values, value.encode()))
        return cls(MappingProxyType(keys))

    def __bool__(self) -> bool:
        return bool(self.keys)

    def check(self, group: str, values: Callable[[str], Sequence[str | bytes]]) -> None:
        """Raise ``Forbidden`` unless ``group`` is open or ``values(name)`` (the
        request's values of a header: none, one, or more) is one of its keys, once
        (``KeyRepeated`` if the header comes more than once)."""
        self.holder(group, values)

    def holder(self, group: str, values: Callable[[str], Sequence[str | bytes]]) -> int | None:
        """Which of ``group``'s keys the request holds (its index, in the order given;
        None: the group is open), as ``check`` raises otherwise."""
        key = self.keys.get(group)
        if key is None:
            return None
        name, wants = key
        got = values(name)
        if len(got) > 1:
            raise KeyRepeated(f"the {name!r} header was sent {len(got)} times: send it once")
        value = got[0] if got else None
        if isinstance(value, str):
            value = value.encode("latin-1", "replace")
        held = None
        if value is not None:
            for i, want in enumerate(wants):  # (every key compared: the time says none)
                if hmac.compare_digest(value, want) and held is None:
                    held = i
        if held is None:
            raise Forbidden(f"the {group} API is restricted: send its key in the {name!r} header")
        return held


def header_values(headers: Sequence[tuple[bytes, bytes]]) -> Callable[[str], list[bytes]]:
    """``Restrictions.check``'s ``values`` over a list of (lower-case name, value) pairs."""

    def values(name: str) -> list[bytes]:
        key = name.encode("latin-1")
        return [v for k, v in headers if k == key]

    return values


@dataclasses.dataclass(frozen=True)
class TlsFiles:
    """The PEM files of ``pxrt serve``'s TLS: its certificate chain, its key, and the
    CAs whose client certificates it requires (None: no client certificates)."""

    cert: str
    key: str
    ca: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TlsFiles | None:
        """From ``--tls-cert``/``--tls-key``/``--tls-ca``; None without them. The files
        are loaded once here, so a wrong path or a key that does not match the
        certificate stops start-up with its message (``OSError``)."""
        if not (args.tls_cert or args.tls_key or args.tls_ca):
            return None
        if not (args.tls_cert and args.tls_key):
            raise OptionError("--tls-cert and --tls-key go together (--tls-ca needs both)")
        files = cls(args.tls_cert, args.tls_key, args.tls_ca)
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(files.cert, files.key)
        if files.ca:
            context.load_verify_locations(files.ca)
        return files

    def uvicorn_options(self) -> dict[str, Any]:
        """``uvicorn.Config`` keyword arguments serving HTTPS with these files."""
        options: dict[str, Any] = {"ssl_certfile": self.cert, "ssl_keyfile": self.key}
        if self.ca:
            options.update(ssl_ca_certs=self.ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
        return options

    def server_context(self, alpn: list[str] | None = None) -> ssl.SSLContext:
        """A server-side ``ssl.SSLContext`` with these files (offering ``alpn``)."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.cert, self.key)
        if self.ca:
            context.load_verify_locations(self.ca)
            context.verify_mode = ssl.CERT_REQUIRED
        if alpn:
            context.set_alpn_protocols(alpn)
        return context

    def grpc_credentials(self) -> Any:
        """``grpc.ServerCredentials`` for ``add_secure_port``."""
        import grpc

        def read(path: str) -> bytes:
            with open(path, "rb") as f:
                return f.read()

        return grpc.ssl_server_credentials(
            [(read(self.key), read(self.cert))],
            root_certificates=read(self.ca) if self.ca else None,
            require_client_auth=self.ca is not None,
        )


__all__ = ["GROUPS", "Forbidden", "KeyRepeated", "Restrictions", "TlsFiles", "header_values"]
