"""Throwaway certificates for the upstream-TLS tests, made with the `openssl` command line (no Python dependency):
a CA, a worker (server) certificate for 127.0.0.1/localhost and a client certificate signed by it, and a rogue CA
with a worker certificate nobody trusts."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_cert: Path
    """A worker certificate for the same names, signed by a CA the gateway does not trust."""
    rogue_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2", "-subj", f"/CN={name}",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             "-addext", "subjectKeyIdentifier=hash", cwd=d)


def _leaf(d: Path, name: str, ca: str, ext: str) -> None:
    (d / f"{name}.ext").write_text("basicConstraints=CA:FALSE\nsubjectKeyIdentifier=hash\n"
                                   f"authorityKeyIdentifier=keyid\n{ext}\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext", cwd=d)


def make_pki(d: Path) -> Pki:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command line is not installed")
    d.mkdir(parents=True, exist_ok=True)
    # Workers also act as clients of each other (the simulator's vLLM KV pull runs over its peer's HTTP port).
    server_ext = "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth"
    _ca(d, "ca")
    _leaf(d, "server", "ca", server_ext)
    _leaf(d, "client", "ca", "extendedKeyUsage=clientAuth")
    _ca(d, "rogue-ca")
    _leaf(d, "rogue", "rogue-ca", server_ext)
    return Pki(ca=d / "ca.crt", server_cert=d / "server.crt", server_key=d / "server.key",
               client_cert=d / "client.crt", client_key=d / "client.key", rogue_cert=d / "rogue.crt",
               rogue_key=d / "rogue.key")
