"""docs/troubleshooting.md quotes the lines kxpu prints: each phrase below is in both the source that prints
it and the doc, so a reworded message without its doc entry (or a doc entry for a line gone) fails here."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "troubleshooting.md").read_text()

QUOTED = [
    ("kxpu/cli.py", "applies to a resource served through DRA, and this one has "),
    ("kxpu/backends/registry.py", "set, but {what} is off: set {switch}: true to use"),
    ("kxpu/backends/fakes.py", "no such kxpu variable; a fake machine is named by"),
    ("kxpu/backends/fakes.py", "is plugged in: kxpu plays a fake machine only when its "),
    (
        "kxpu/backends/fakes.py",
        "command line imports the fake (--import, see docs/troubleshooting.md); add that, or unset",
    ),
    ("kxpu/backends/nvidia/backend.py", "which this node does not have (GPUs present: {present}); "),
    (
        "kxpu/cli.py",
        "no access to the API server: {exc}; run it in a pod with a service account, or set KUBECONFIG",
    ),
    ("kxpu/cli.py", "cannot read it: {exc.strerror or exc}"),
    ("kxpu/cli.py", "serving through DRA needs the node name (dra.nodeName or $NODE_NAME)"),
    ("kxpu/cli.py", "sharing needs the node name (sharing.nodeName or $NODE_NAME)"),
    ("kxpu/sharing/probes.py", "must be [HOST]:PORT"),
    ("kxpu/dra/plugin.py", "publishing ResourceSlices failed; retrying"),
    ("kxpu/dra/plugin.py", "the kubelet refused the registration"),
    ("kxpu/dra/checkpoint.py", "DRA checkpoint unusable; starting with no prepared claims"),
    ("kxpu/sharing/webhook.py", "(the pod was not admitted: retry)"),
    ("kxpu/sharing/claims.py", "become a DRA claim (capacity requests are absolute, in MiB): ask for"),
    ("kxpu/sharing/claims.py", "for one pod: give its containers fewer distinct shared-device requests"),
    ("kxpu/dra/config.py", "(POD_UID) cannot name a socket: use the pod's UID (downward API metadata.uid)"),
    (
        "kxpu/dra/plugin.py",
        "another process of this driver publishes its ResourceSlices; waiting for it to stop",
    ),
]


def _as_doc(phrase: str) -> str:
    """The phrase as the doc shows an instance of it: placeholders filled as the doc's examples fill them."""
    return (
        phrase.replace("{what} is off: set {switch}: true", "telemetry is off: set enabled: true")
        .replace("{present}", "0, 1, …")
        .replace("{exc}; run", "Configuration file ~/.kube/config not found; run")
        .replace("{exc.strerror or exc}", "No such file or directory")
    )


@pytest.mark.parametrize(("source", "phrase"), QUOTED, ids=[p[:40] for _, p in QUOTED])
def test_the_doc_quotes_what_kxpu_prints(source: str, phrase: str) -> None:
    assert phrase in (ROOT / source).read_text(), f"{source} no longer prints: {phrase}"
    assert _as_doc(phrase) in DOC, f"docs/troubleshooting.md does not explain: {_as_doc(phrase)}"
