"""TLS on extproc's ext_proc port (extproc.tls, `cortex epp`): the certificate it serves, and where local health
checks reach it instead.

GIE's gateways (its charts for Envoy Gateway, kgateway, Istio, GKE; its reference Envoy) connect to the endpoint
picker over TLS and, since GIE's picker serves a self-signed certificate by default, do not check it. With
`extproc.tls: {}` Cortex does the same: a certificate made once per start by the supervisor, before any extproc
process, so every process serves the same one. Ingest's readiness and the supervisor's start gate are local: they
reach each process over a Unix socket in runtime_dir, where the same gRPC server also listens, instead of
verifying a certificate made for a gateway that does not verify it either.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from pathlib import Path

from cortex.config import CortexConfig


def files(cfg: CortexConfig) -> tuple[Path, Path]:
    """(certificate, key) served: the configured pair, or the self-signed pair in runtime_dir/tls."""
    tls = cfg.extproc.tls
    assert tls is not None
    if tls.cert_file is not None and tls.key_file is not None:
        return Path(tls.cert_file), Path(tls.key_file)
    root = cfg.runtime_path() / "tls"
    return root / "extproc.crt", root / "extproc.key"


def health_address(cfg: CortexConfig, index: int, host: str) -> str:
    """Where a local health check reaches extproc process `index`: its TCP port, or its Unix socket under TLS."""
    if cfg.extproc.tls is None:
        return f"{host}:{cfg.extproc.base_port + index}"
    return f"unix:{local_socket(cfg.runtime_path(), index)}"


def local_socket(runtime: Path, index: int) -> Path:
    return runtime / "tls" / f"extproc-{index}.sock"


def ensure_self_signed(cfg: CortexConfig) -> None:
    """Make the self-signed certificate when extproc.tls asks for one (no files configured). A new key each start:
    nothing checks it, so nothing needs it kept."""
    tls = cfg.extproc.tls
    if tls is None or tls.cert_file is not None:
        return
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    cert_path, key_path = files(cfg)
    cert_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "cortex-epp")])
    now = datetime.datetime.now(datetime.UTC)
    names: list[x509.GeneralName] = [x509.DNSName("localhost"), x509.DNSName("cortex-epp"),
                                     x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    host = socket.gethostname()
    if host and host != "localhost":
        names.append(x509.DNSName(host))
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=365))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .sign(key, hashes.SHA256()))
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def check_files(cfg: CortexConfig) -> str | None:
    """Why the configured certificate cannot be served (one line), or None."""
    if cfg.extproc.tls is None or cfg.extproc.tls.cert_file is None:
        return None
    for field, path in zip(("cert_file", "key_file"), files(cfg), strict=True):
        try:
            path.read_bytes()
        except OSError as exc:
            return f"extproc.tls.{field}: cannot read {path}: {exc.strerror or exc}"
    return None
