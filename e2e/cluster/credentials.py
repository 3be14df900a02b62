"""Credentials: the cluster's CA, a certificate per identity (API server, kubelet, admin, controllers), the
service-account signing key, and a kubeconfig per client (admin for kubectl and the tests, controller-manager,
scheduler, kubelet). ``issue_certificate`` makes more for a scenario (e.g. a webhook's serving certificate)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from e2e.cluster.base import ClusterBase, _run
from e2e.cluster.layout import API_PORT, NODE_IP, NODE_NAME, SERVICE_IP


class Credentials(ClusterBase):
    def _certificates(self) -> None:
        """A CA and one EC key/certificate per identity; the service-account signing key."""
        pki = self.pki
        _openssl_conf(pki / "ca.cnf", "kxpu-e2e-ca", None, ca=True)
        _run(
            [
                "openssl",
                "req",
                "-x509",
                "-new",
                "-nodes",
                "-config",
                str(pki / "ca.cnf"),
                "-extensions",
                "ext",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-keyout",
                str(pki / "ca.key"),
                "-out",
                str(pki / "ca.crt"),
                "-days",
                "3650",
            ]
        )
        api_sans = [
            "IP:127.0.0.1",
            f"IP:{SERVICE_IP}",
            "DNS:localhost",
            "DNS:kubernetes",
            "DNS:kubernetes.default",
            "DNS:kubernetes.default.svc",
            "DNS:kubernetes.default.svc.cluster.local",
        ]
        identities: dict[str, tuple[str, str | None, list[str] | None]] = {
            "apiserver": ("kube-apiserver", None, api_sans),
            "apiserver-kubelet-client": ("kube-apiserver-kubelet-client", "system:masters", None),
            "admin": ("kubernetes-admin", "system:masters", None),
            "front-proxy-client": ("front-proxy-client", None, None),
            "controller-manager": ("system:kube-controller-manager", None, None),
            "scheduler": ("system:kube-scheduler", None, None),
            "kubelet-client": (f"system:node:{NODE_NAME}", "system:nodes", None),
            "kubelet": (
                NODE_NAME,
                None,
                [f"IP:{NODE_IP}", "IP:127.0.0.1", f"DNS:{NODE_NAME}", "DNS:localhost"],
            ),
        }
        for name, (cn, org, sans) in identities.items():
            self.issue_certificate(pki, name, cn, org, sans)
        _run(["openssl", "ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", str(pki / "sa.key")])
        _run(["openssl", "ec", "-in", str(pki / "sa.key"), "-pubout", "-out", str(pki / "sa.pub")])
        (pki / "ca.key").chmod(0o600)
        (pki / "sa.key").chmod(0o600)

    def issue_certificate(
        self, into: Path, name: str, cn: str, org: str | None = None, sans: list[str] | None = None
    ) -> tuple[Path, Path]:
        """An EC key and a certificate signed by the cluster's CA, as ``into/name.{crt,key}`` (serving if ``sans``)."""
        conf = into / f"{name}.cnf"
        _openssl_conf(conf, cn, org, sans=sans)
        key, csr, crt = (into / f"{name}.{ext}" for ext in ("key", "csr", "crt"))
        _run(
            [
                "openssl",
                "req",
                "-new",
                "-nodes",
                "-config",
                str(conf),
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-keyout",
                str(key),
                "-out",
                str(csr),
            ]
        )
        _run(
            [
                "openssl",
                "x509",
                "-req",
                "-in",
                str(csr),
                "-CA",
                str(self.pki / "ca.crt"),
                "-CAkey",
                str(self.pki / "ca.key"),
                "-set_serial",
                str(int.from_bytes(os.urandom(8), "big")),
                "-days",
                "365",
                "-extfile",
                str(conf),
                "-extensions",
                "ext",
                "-out",
                str(crt),
            ]
        )
        key.chmod(0o600)
        return crt, key

    def _kubeconfigs(self) -> None:
        for name, cert in [
            ("admin", "admin"),
            ("controller-manager", "controller-manager"),
            ("scheduler", "scheduler"),
            ("kubelet", "kubelet-client"),
        ]:
            config = {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "kxpu-e2e",
                        "cluster": {
                            "server": f"https://127.0.0.1:{API_PORT}",
                            "certificate-authority": str(self.pki / "ca.crt"),
                        },
                    }
                ],
                "users": [
                    {
                        "name": name,
                        "user": {
                            "client-certificate": str(self.pki / f"{cert}.crt"),
                            "client-key": str(self.pki / f"{cert}.key"),
                        },
                    }
                ],
                "contexts": [{"name": "kxpu-e2e", "context": {"cluster": "kxpu-e2e", "user": name}}],
                "current-context": "kxpu-e2e",
            }
            (self.state / f"{name}.kubeconfig").write_text(json.dumps(config, indent=2) + "\n")


def _openssl_conf(
    path: Path, cn: str, org: str | None, sans: list[str] | None = None, ca: bool = False
) -> None:
    lines = ["[req]", "distinguished_name = dn", "prompt = no", "[dn]", f"CN = {cn}"]
    if org:
        lines.append(f"O = {org}")
    lines.append("[ext]")
    if ca:
        lines += [
            "basicConstraints = critical,CA:TRUE",
            "keyUsage = critical,keyCertSign,cRLSign,digitalSignature",
            "subjectKeyIdentifier = hash",
        ]
    else:
        usage = "serverAuth,clientAuth" if sans else "clientAuth"
        lines += [
            "basicConstraints = critical,CA:FALSE",
            "keyUsage = critical,digitalSignature,keyEncipherment",
            f"extendedKeyUsage = {usage}",
            "authorityKeyIdentifier = keyid",
        ]
        if sans:
            lines.append("subjectAltName = " + ",".join(sans))
    path.write_text("\n".join(lines) + "\n")
