"""TLS material for a deployment: a CA, the SuperLink's certificate, the silos' node keys.

- ``ca.crt`` / ``ca.key``: a self-signed certificate authority (keep ``ca.key`` offline).
- ``server.pem`` / ``server.key``: the SuperLink's certificate, signed by the CA, valid for every
  name and address the silos dial (subject alternative names). Silos check it against ``ca.crt``.
- ``nodes/<name>`` / ``nodes/<name>.pub``: one EC key pair per silo in OpenSSH format, what
  Flower's node authentication expects. The SuperLink admits only registered public keys.

Node keys are NIST P-256 (128-bit security), the certificates P-384. Node authentication signs
every request a silo makes and the SuperLink verifies every one (~11 per silo and round on the
quick example), while a certificate's key works once per connection. Here P-384 took 0.23 ms to
sign and 0.51 ms to verify, P-256 0.03 and 0.07 ms: ~7 ms of CPU less per silo and round, on
the cores the silos train on (bench/RESULTS.md). Flower accepts a key on any NIST curve,
so keys made before keep working.

Private keys are written with mode 0600.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_DAYS = 825  # the longest validity common TLS clients accept for leaf certificates
NODE_CURVE = ec.SECP256R1  # signs and is verified on every request (module docstring)


@dataclass(frozen=True)
class CertificatePaths:
    ca_certificate: Path
    ca_key: Path
    server_certificate: Path
    server_key: Path
    nodes: dict[str, tuple[Path, Path]]  # name -> (private key, public key)


def _write(path: Path, data: bytes, private: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    fd = os.open(path, flags, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    os.chmod(path, 0o600 if private else 0o644)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "dpcfl-flwr"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(entries: Sequence[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for entry in entries:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(entry)))
        except ValueError:
            names.append(x509.DNSName(entry))
    return x509.SubjectAlternativeName(names)


def make_ca(common_name: str = "dpcfl-flwr CA") -> tuple[ec.EllipticCurvePrivateKey,
                                                         x509.Certificate]:
    key = ec.generate_private_key(ec.SECP384R1())
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(_name(common_name))
            .issuer_name(_name(common_name)).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=3650))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False,
                                         False), critical=True)
            .sign(key, hashes.SHA384()))
    return key, cert


def make_server_certificate(ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate,
                            names: Sequence[str]) -> tuple[ec.EllipticCurvePrivateKey,
                                                           x509.Certificate]:
    """A SuperLink certificate valid for ``names`` (DNS names and/or IP addresses)."""
    if not names:
        raise ValueError("the server certificate needs at least one name or address (--san)")
    key = ec.generate_private_key(ec.SECP384R1())
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(_name(names[0]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=VALID_DAYS))
            .add_extension(_san(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA384()))
    return key, cert


def make_node_keys(directory: Path, name: str) -> tuple[Path, Path]:
    """An EC key pair for Flower node authentication (OpenSSH format, NIST P-256)."""
    key = ec.generate_private_key(NODE_CURVE())
    private = key.private_bytes(serialization.Encoding.PEM,
                                serialization.PrivateFormat.OpenSSH,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                           serialization.PublicFormat.OpenSSH)
    private_path, public_path = directory / name, directory / f"{name}.pub"
    _write(private_path, private, private=True)
    _write(public_path, public + f" {name}\n".encode(), private=False)
    return private_path, public_path


def make_certificates(out: Path, server_names: Sequence[str], node_names: Sequence[str],
                      overwrite: bool = False) -> CertificatePaths:
    """Write a CA, a SuperLink certificate and node key pairs under ``out``."""
    paths = CertificatePaths(out / "ca.crt", out / "ca.key", out / "server.pem",
                             out / "server.key",
                             {n: (out / "nodes" / n, out / "nodes" / f"{n}.pub")
                              for n in node_names})
    if paths.ca_certificate.exists() and not overwrite:
        raise FileExistsError(f"{paths.ca_certificate} exists; pass --overwrite to replace the "
                              "CA (every silo then needs the new ca.crt)")
    ca_key, ca_cert = make_ca()
    server_key, server_cert = make_server_certificate(ca_key, ca_cert, server_names)
    _write(paths.ca_certificate, ca_cert.public_bytes(serialization.Encoding.PEM), False)
    _write(paths.ca_key, _pem_key(ca_key), True)
    _write(paths.server_certificate, server_cert.public_bytes(serialization.Encoding.PEM),
           False)
    _write(paths.server_key, _pem_key(server_key), True)
    for name in node_names:
        make_node_keys(out / "nodes", name)
    return paths


def certificate_names(certificate: x509.Certificate) -> list[str]:
    """The DNS names and IP addresses ``certificate`` is valid for (its subject alternative
    names), as ``dpcfl certs --san`` takes them."""
    try:
        names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [str(name.value) for name in names]


def _covers(names: Sequence[str], wanted: str) -> bool:
    try:
        address = ipaddress.ip_address(wanted.strip("[]"))
    except ValueError:
        return wanted.lower() in (name.lower() for name in names)
    return any(_ip(name) == address for name in names)


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


def server_certificate_problems(directory: Path, dialled: Sequence[str]) -> list[str]:
    """Why ``directory``'s ``server.pem`` cannot serve a SuperLink that is dialled at the hosts
    ``dialled`` (by its own tools: key registration, Flower's SuperExec), one line each: not
    issued by ``ca.crt``, not matching ``server.key``, expired, or not valid for a host."""
    pem, key_path, ca = (directory / "server.pem", directory / "server.key",
                         directory / "ca.crt")
    try:
        certificate = x509.load_pem_x509_certificate(pem.read_bytes())
        ca_certificate = x509.load_pem_x509_certificate(ca.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        return [f"{directory}: the SuperLink's certificate, key or CA cannot be read ({exc})"]
    problems = []
    try:
        certificate.verify_directly_issued_by(ca_certificate)
    except (ValueError, TypeError, InvalidSignature):
        problems.append(f"{pem} was not issued by {ca}: silos that trust {ca} would refuse it")
    if key.public_key() != certificate.public_key():
        problems.append(f"{key_path} is not the key of {pem}")
    if certificate.not_valid_after_utc < dt.datetime.now(dt.UTC):
        problems.append(f"{pem} expired on {certificate.not_valid_after_utc:%Y-%m-%d}")
    names = certificate_names(certificate)
    missing = [host for host in dialled if not _covers(names, host)]
    if missing:
        problems.append(
            f"{pem} is not valid for {', '.join(missing)}, which this SuperLink's own tools "
            f"dial (it names {', '.join(names) or 'nothing'}): make it again with `dpcfl "
            f"certs --keep --san {' --san '.join([*names, *missing])}` (the CA and node keys "
            "are kept)")
    return problems


def keep_certificates(out: Path, server_names: Sequence[str],
                      node_names: Sequence[str]) -> list[str]:
    """Keep the CA and the keys under ``out`` and make only what is missing or does not fit:
    a SuperLink certificate that is not valid for every name in ``server_names`` is made
    again from the kept CA (silos keep trusting ``ca.crt``), missing node keys are made.
    Returns what was done, one line each; raises ValueError when the CA key is needed and
    absent."""
    done = []
    ca_key_path = out / "ca.key"
    try:
        kept = x509.load_pem_x509_certificate((out / "server.pem").read_bytes())
        missing = [name for name in server_names if not _covers(certificate_names(kept), name)]
        reason = f"the kept one was not valid for {', '.join(missing)}" if missing else None
    except (OSError, ValueError):
        reason = "there was none that could be read"
    if reason is not None:
        if not ca_key_path.is_file():
            raise ValueError(f"{out / 'server.pem'} must be made again ({reason}), but "
                             f"{ca_key_path} is not here to sign it")
        ca_key = serialization.load_pem_private_key(ca_key_path.read_bytes(), password=None)
        ca_certificate = x509.load_pem_x509_certificate((out / "ca.crt").read_bytes())
        if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{ca_key_path} is not the elliptic-curve key `dpcfl certs` makes")
        server_key, server_cert = make_server_certificate(ca_key, ca_certificate,
                                                          server_names)
        _write(out / "server.pem", server_cert.public_bytes(serialization.Encoding.PEM), False)
        _write(out / "server.key", _pem_key(server_key), True)
        done.append(f"made a new SuperLink certificate for {', '.join(server_names)} from the "
                    f"kept CA: {reason}")
    made = [name for name in node_names if not (out / "nodes" / name).is_file()]
    for name in made:
        make_node_keys(out / "nodes", name)
    if made:
        done.append(f"made {len(made)} missing node key pair(s): {', '.join(made)}")
    return done


def certificate_problems(path: Path) -> list[str]:
    """Why ``path`` is not a readable PEM certificate (a CA for a SuperNode or a SuperLink), one
    line each; empty when it is."""
    try:
        x509.load_pem_x509_certificate(path.read_bytes())
    except OSError as exc:
        return [f"root-certificates {path}: {exc.strerror or exc}"]
    except ValueError:
        return [f"root-certificates {path}: not a PEM certificate"]
    return []
