"""`pxrt serve` as a real process, for the tests that drive it over HTTP."""

from __future__ import annotations

import os
import random
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    return free_ports(1)[0]


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 by default)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports, all held open while choosing (none repeats), drawn
    below the kernel's ephemeral range: a port the kernel hands out (a bind to port 0,
    a client's connection, one of Ray's many workers) cannot take one between this
    choice and the server's bind, as it once took Ray's proxy port."""
    high = _ephemeral_low()
    low = max(1024, high - 12000)
    rng = random.Random()
    sockets: list[socket.socket] = []
    try:
        while len(sockets) < n:
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", rng.randrange(low, high)))
            except OSError:  # (in use)
                s.close()
                continue
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def children(pid: int) -> list[int]:
    """The pids of a process's live children (from /proc): `pxrt serve --workers`'s."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(entry))
    return out


def decoder_config(folder, path, name: str = "lm", **options) -> str:
    """A ``pxrt serve --config`` TOML serving the decoder at ``path`` as ``name`` with
    ``options`` (its pxrt.load options: ``step_slots=[]``...); returns its path."""

    def toml(value) -> str:
        if isinstance(value, bool):
            return "true" if value else "false"
        return repr(list(value)) if isinstance(value, (list, tuple)) else repr(value)

    lines = [f"[models.{name}]", f"path = {str(path)!r}"]
    lines += [f"{key} = {toml(value)}" for key, value in options.items()]
    conf = os.path.join(str(folder), f"{name}.toml")
    with open(conf, "w") as f:
        f.write("\n".join(lines) + "\n")
    return conf


def make_certs(folder) -> dict[str, str]:
    """A CA, a server certificate it signed for 127.0.0.1 and localhost, and a client
    certificate it signed: name -> PEM path (``ca``, ``cert``, ``key``, ``client_cert``,
    ``client_key``)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    now = datetime.datetime.now(datetime.UTC)

    def issue(subject, key, issuer, issuer_key, ca=False, san=None):
        builder = (
            x509.CertificateBuilder()
            .subject_name(name(subject))
            .issuer_name(name(issuer))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    ca_key, server_key, client_key = (ec.generate_private_key(ec.SECP256R1()) for _ in "abc")
    ca = issue("pxrt test CA", ca_key, "pxrt test CA", ca_key, ca=True)
    san = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
    server = issue("localhost", server_key, "pxrt test CA", ca_key, san=san)
    client = issue("client", client_key, "pxrt test CA", ca_key)
    paths = {}
    for label, obj in [("ca", ca), ("cert", server), ("client_cert", client)]:
        paths[label] = os.path.join(folder, label + ".pem")
        with open(paths[label], "wb") as f:
            f.write(obj.public_bytes(serialization.Encoding.PEM))
    for label, key in [("key", server_key), ("client_key", client_key)]:
        paths[label] = os.path.join(folder, label + ".pem")
        with open(paths[label], "wb") as f:
            f.write(
                key.private_bytes(
                    serialization.Encoding.PEM,
                    serialization.PrivateFormat.PKCS8,
                    serialization.NoEncryption(),
                )
            )
    return paths


class ServeProcess:
    def __init__(self, args: list[str], grpc: bool = False, tls: dict | None = None):
        """``tls``: ``make_certs``' files; the server is started with them (and reached
        over https, trusting their CA, presenting the client certificate)."""
        self.port, grpc_port = free_ports(2)
        self.tls = tls
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        if tls:
            args = [*args, "--tls-cert", tls["cert"], "--tls-key", tls["key"]]
        self.grpc_port = grpc_port if grpc else None
        self.grpc_url = f"127.0.0.1:{self.grpc_port}"
        if grpc:
            args = [*args, "--grpc-port", str(self.grpc_port)]
        # A file, not a pipe: nobody reads a pipe while tests run, and a full one blocks.
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "serving.cli", "serve", "--port", str(self.port), *args],
            cwd=ROOT,
            env=dict(os.environ),
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pxrt serve exited: {self.output()}")
            try:
                if self.get("/v2/health/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        output = self.output()
        self.stop()
        raise RuntimeError(f"pxrt serve did not become ready: {output}")

    def get(self, path: str, **kw) -> httpx.Response:
        """GET ``path``, over TLS when the server serves it (presenting the client
        certificate)."""
        if self.tls:
            kw["verify"] = self.ssl_context()
        return httpx.get(self.url + path, **kw)

    def ssl_context(self, client_cert: bool = True) -> ssl.SSLContext:
        """Trusting the test CA, presenting the client certificate (``client_cert``)."""
        assert self.tls
        context = ssl.create_default_context(cafile=self.tls["ca"])
        if client_cert:
            context.load_cert_chain(self.tls["client_cert"], self.tls["client_key"])
        return context

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> int:
        """SIGTERM, then the exit status; its output stays in ``last_output``."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        finally:
            if not self.log.closed:
                self.last_output = self.output()
            self.log.close()
