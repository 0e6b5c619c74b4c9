"""Internal-plane TLS, mutual: worker gRPC servers, the router's channels to them and KV-transfer connections
are encrypted, and each end proves it holds a certificate from the cluster's private CA. Optional, on top of
the cluster secret (cluster/cluster_secret.py), which authenticates calls either way.

    files     --internal-tls-dir DIR holding ca.crt (the cluster's CA), tls.crt and tls.key (this component's
              certificate and key): the layout of a kubernetes.io/tls Secret with its CA, as cert-manager and
              the Helm chart write it
    env       $DUET_INTERNAL_TLS_CA, _CERT and _KEY (PEM text) override the files; the Ray launcher passes
              them in the runtime env, `duet up` writes a directory
    identity  every certificate names SERVER_NAME and peers check that name, not the address: workers are
              reached at pod IPs no certificate can list in advance, and what a peer must prove is that it
              belongs to this cluster, which a certificate from its CA does
    KV        the TCP transport wraps its sockets (kvtransfer/tls_socket.py); the torch.distributed transport
              sends payloads outside the socket, unencrypted, so it is refused where TLS is on

`generate()` makes a CA and one certificate for the whole cluster (`duet up`, the Ray launcher); the CA's
key is dropped, so nothing can issue a second certificate for that cluster.
"""

from __future__ import annotations

import datetime
import os
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path

import grpc

SERVER_NAME = "duet-internal"
ENV_VARS = {"ca": "DUET_INTERNAL_TLS_CA", "cert": "DUET_INTERNAL_TLS_CERT", "key": "DUET_INTERNAL_TLS_KEY"}
FILE_NAMES = {"ca": "ca.crt", "cert": "tls.crt", "key": "tls.key"}
VALID_DAYS = 3650


@dataclass(frozen=True, repr=False)
class InternalTLS:
    """One component's TLS material (PEM). Its repr names no key material."""

    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes

    def __repr__(self) -> str:
        return "InternalTLS(...)"

    @classmethod
    def load(cls, directory: Path | str | None = None) -> InternalTLS | None:
        """From the environment if all three variables are set, else from `directory`, else None. A partial
        set (one variable, or a directory missing a file) is a ValueError naming what is missing."""
        given = {part: os.environ.get(var) for part, var in ENV_VARS.items()}
        if any(given.values()):
            if missing := [ENV_VARS[part] for part, text in given.items() if not text]:
                raise ValueError(f"internal TLS from the environment needs all of {', '.join(ENV_VARS.values())}; "
                                 f"missing {', '.join(missing)}")
            return cls(*(given[part].encode() for part in ("ca", "cert", "key")))
        if directory is None:
            return None
        paths = {part: Path(directory) / name for part, name in FILE_NAMES.items()}
        if missing := [str(path) for path in paths.values() if not path.is_file()]:
            raise ValueError(f"--internal-tls-dir={directory} must hold {', '.join(FILE_NAMES.values())}; "
                             f"missing {', '.join(missing)}")
        return cls(*(paths[part].read_bytes() for part in ("ca", "cert", "key")))

    def env(self) -> dict[str, str]:
        """The environment that makes `load()` return this material (for child processes and Ray actors)."""
        return {ENV_VARS["ca"]: self.ca_pem.decode(), ENV_VARS["cert"]: self.cert_pem.decode(),
                ENV_VARS["key"]: self.key_pem.decode()}

    def write(self, directory: Path | str) -> Path:
        """Write ca.crt, tls.crt and tls.key into `directory` (created; the key readable by its owner only)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        for part, pem in (("ca", self.ca_pem), ("cert", self.cert_pem), ("key", self.key_pem)):
            path = directory / FILE_NAMES[part]
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(pem)
        return directory

    # -- gRPC ------------------------------------------------------------------------------------------

    def server_credentials(self) -> grpc.ServerCredentials:
        """A server that admits only clients presenting a certificate from the cluster CA."""
        return grpc.ssl_server_credentials([(self.key_pem, self.cert_pem)], root_certificates=self.ca_pem,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca_pem, private_key=self.key_pem,
                                            certificate_chain=self.cert_pem)

    # the name a channel checks in the server's certificate, whatever address it dials
    CHANNEL_OPTIONS = (("grpc.ssl_target_name_override", SERVER_NAME),)

    # -- sockets (KV transfer) -------------------------------------------------------------------------

    def server_context(self) -> ssl.SSLContext:
        context = self._context(ssl.PROTOCOL_TLS_SERVER)
        context.verify_mode = ssl.CERT_REQUIRED  # the sender must show a certificate from the cluster CA
        return context

    def client_context(self) -> ssl.SSLContext:
        return self._context(ssl.PROTOCOL_TLS_CLIENT)  # checks the receiver's certificate and SERVER_NAME

    def _context(self, protocol: int) -> ssl.SSLContext:
        context = ssl.SSLContext(protocol)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        context.load_verify_locations(cadata=self.ca_pem.decode())
        # OpenSSL reads a certificate chain from files only: a private directory that lives for this call
        with tempfile.TemporaryDirectory(prefix="duet-tls-") as tmp:
            cert, key = Path(tmp) / "tls.crt", Path(tmp) / "tls.key"
            for path, pem in ((cert, self.cert_pem), (key, self.key_pem)):
                fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(pem)
            context.load_cert_chain(cert, key)
        return context


def kv_sender_tls(tls: InternalTLS | None) -> dict[str, object]:
    """KVSender's TLS arguments: a client context and the name receivers' certificates carry (none without)."""
    return {} if tls is None else {"tls_context": tls.client_context(), "tls_server_name": SERVER_NAME}


def kv_receiver_tls(tls: InternalTLS | None) -> dict[str, object]:
    """KVReceiver's TLS arguments (none without)."""
    return {} if tls is None else {"tls_context": tls.server_context()}


def generate(valid_days: int = VALID_DAYS) -> InternalTLS:
    """A fresh CA and one certificate (for SERVER_NAME, server and client use) signed by it. ECDSA P-256."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=valid_days)  # clock skew

    def name(common_name: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = name("duet cluster CA")
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(start).not_valid_after(end)
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                            key_encipherment=False, data_encipherment=False, key_agreement=False,
                                            key_cert_sign=True, crl_sign=True, encipher_only=False,
                                            decipher_only=False), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
               .sign(ca_key, hashes.SHA256()))
    cert = (x509.CertificateBuilder().subject_name(name(SERVER_NAME)).issuer_name(ca_name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(SERVER_NAME)]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    return InternalTLS(
        ca_pem=ca_cert.public_bytes(pem), cert_pem=cert.public_bytes(pem),
        key_pem=key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
