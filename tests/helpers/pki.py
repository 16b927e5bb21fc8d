"""Certificates made on the fly for the TLS tests, and the cluster token they run with."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from starjar.service.security import Security

TOKEN = "s3cret-cluster-token-0123456789"


def make_pki(root: Path) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1/localhost and two client certificates, written under `root`;
    their paths by file name (the `pki` fixture of conftest.py)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write(stem, key, cert):
        (root / f"{stem}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                             serialization.PrivateFormat.PKCS8,
                                                             serialization.NoEncryption()))
        (root / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("starjar test CA")).issuer_name(name("starjar test CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(ca_key, hashes.SHA256()))
    write("ca", ca_key, ca)
    for stem, cn in (("server", "localhost"), ("client_a", "target-a"), ("client_b", "target-b")):
        key = ec.generate_private_key(ec.SECP256R1())
        b = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(ca.subject).public_key(key.public_key())
             .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=1)))
        if stem == "server":
            b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                             x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                                critical=False)
        write(stem, key, b.sign(ca_key, hashes.SHA256()))
    return {k: str(root / k) for k in ("ca.pem", "server.pem", "server.key", "client_a.pem", "client_a.key",
                                       "client_b.pem", "client_b.key")}


def client_security(pki: dict[str, str], who: str | None) -> Security:
    """A caller's Security: the token and the CA, plus the client certificate `who` (None: server-side TLS only)."""
    if who is None:
        return Security(token=TOKEN, tls_ca=pki["ca.pem"])
    return Security(token=TOKEN, tls_ca=pki["ca.pem"], tls_cert=pki[f"{who}.pem"], tls_key=pki[f"{who}.key"])
