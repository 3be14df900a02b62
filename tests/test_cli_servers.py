"""`kxpu scheduler` and `kxpu webhook` started wrong: one line on stderr and a consistent exit status (2 for
what the command line or the environment gets wrong, 1 for a failure while serving), never a traceback."""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """kxpu with no way to the API server: no service account, no KUBECONFIG, an empty home."""
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")}
    return subprocess.run(
        [sys.executable, "-m", "kxpu", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, "HOME": str(tmp_path)},
    )


def test_scheduler_without_api_access_is_one_line(tmp_path: Path) -> None:
    result = run(tmp_path, "scheduler", "--address", "127.0.0.1:0", "--metrics-address", "")
    assert result.returncode == 2
    assert result.stderr == (
        "kxpu: error: no access to the API server: Configuration file ~/.kube/config not found; "
        "run it in a pod with a service account, or set KUBECONFIG\n"
    )


@pytest.mark.parametrize("command", ["scheduler", "webhook"])
def test_a_bad_address_is_one_line(tmp_path: Path, command: str) -> None:
    tls = ["--tls-cert-file", "/c", "--tls-key-file", "/k"] if command == "webhook" else []
    result = run(tmp_path, command, "--address", "8443", *tls)
    assert result.returncode == 2
    assert result.stderr == "kxpu: error: --address: address '8443' must be [HOST]:PORT\n"


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kxpu-webhook")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_file, key_file


def test_webhook_without_its_certificate_is_one_line(tmp_path: Path) -> None:
    result = run(tmp_path, "webhook", "--tls-cert-file", str(tmp_path / "nope.crt"), "--tls-key-file", "/k")
    assert result.returncode == 2
    assert (
        result.stderr
        == f"kxpu: error: --tls-cert-file {tmp_path}/nope.crt: cannot read it: No such file or directory\n"
    )


def test_webhook_on_a_port_in_use_is_one_line(tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run(
            tmp_path,
            "webhook",
            *("--address", f"127.0.0.1:{port}", "--metrics-address", ""),
            *("--tls-cert-file", str(cert), "--tls-key-file", str(key)),
        )
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if "level=info" not in line]
    assert errors == [
        f"kxpu: error: the admission webhook stopped: OSError: [Errno 98] error while attempting to bind on "
        f"address ('127.0.0.1', {port}): address already in use"
    ], result.stderr
