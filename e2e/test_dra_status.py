"""Claims that report back and devices that describe themselves, on the real 1.37 cluster (docs/dra.md):

- ``ResourceClaim.status.devices`` (KEP-4817): after kxpu prepares a claim, each device's entry (conditions, data:
  UUID, model, memory, health) is in the claim, as ``kubectl get resourceclaim -o yaml`` shows; after the pod ends
  kxpu removes them. The claim is kept allocated meanwhile (a second, non-pod consumer in reservedFor, which the
  claim controller leaves alone), so what removes the entries is kxpu's unprepare, not the API server dropping the
  status of a deallocated claim.
- device metadata files (KEP-5304, ``dra.deviceMetadata``): the container reads its devices' attributes from
  ``/var/run/kubernetes.io/dra-device-attributes/...``, for a claim it names and for one made from a template.
"""

from __future__ import annotations

import json
import re
from typing import Any

from e2e import dra, kube
from e2e.cluster import NODE_NAME
from e2e.conftest import E2E
from e2e.test_dra import DRIVER, npus, start

ATTRS = "/var/run/kubernetes.io/dra-device-attributes"
NAMED_FILE = f"{ATTRS}/resourceclaims/{{claim}}/npu/{DRIVER}-metadata.json"
TEMPLATE_FILE = f"{ATTRS}/resourceclaimtemplates/devices/npu/{DRIVER}-metadata.json"
KEEPER = {"apiGroup": "example.com", "resource": "keepers", "name": "e2e-keeper", "uid": "e2e-keeper-uid"}


def documents(log: str, marker: str) -> list[dict[str, Any]]:
    """The JSON documents the container printed between ``<marker>-begin`` and ``<marker>-end``."""
    match = re.search(rf"^{marker}-begin\n(.*?)^{marker}-end$", log, re.M | re.S)
    assert match, log
    lines = [line for line in match.group(1).splitlines() if line.strip()]
    assert lines and all(line.startswith("{") for line in lines), (
        f"the container could not read its file:\n{log}"
    )
    return [json.loads(line) for line in lines]


def ours(claim: dict[str, Any]) -> list[dict[str, Any]]:
    return [d for d in (claim.get("status") or {}).get("devices", []) if d["driver"] == DRIVER]


def test_status_devices_and_metadata_files(e2e: E2E) -> None:
    resource = npus()
    resource["dra"] = {"deviceMetadata": True}
    start(e2e, resource)
    attributes = {d["name"]: d["attributes"] for d in dra.pool_devices(e2e.cluster, DRIVER)}
    cls = dra.device_class(e2e, "kxpu-status-npu", DRIVER)
    name = f"{e2e.label[:40]}-named"
    dra.apply(
        e2e,
        {
            "apiVersion": dra.API,
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "default", "labels": {"kxpu-e2e": e2e.label}},
            "spec": {"devices": {"requests": [{"name": "npu", "exactly": dra.exactly(cls, 2)}]}},
        },
    )
    e2e.cleanups.append(
        lambda: e2e.cluster.kubectl(
            "delete", "resourceclaim", name, "--ignore-not-found", "--wait=false", check=False
        )
    )
    named_file = NAMED_FILE.format(claim=name)
    pod = kube.PodSpec(
        name=f"{e2e.label[:30]}-named",
        script=f'echo named-begin\ncat "{named_file}"\necho named-end',
        labels={"kxpu-e2e": e2e.label},
        claims=[{"name": "npus", "resourceClaimName": name}],
    )
    e2e.pods.append(pod)
    kube.create_pod(e2e.cluster, pod)
    template = dra.claim_template(e2e, "status-one", [{"name": "npu", "exactly": dra.exactly(cls, 1)}])
    templated = dra.claim_pod(
        e2e, "templated", f'echo tmpl-begin\ncat "{TEMPLATE_FILE}"\necho tmpl-end', template
    )

    # The metadata files, read inside the containers: the devices the scheduler allocated, the slice's attributes.
    kube.wait_pod_phase(e2e.cluster, pod.name, "Running")
    claim = e2e.cluster.kubectl_json("get", "resourceclaim", name, "-n", "default")
    allocated = sorted(dra.allocated_devices(claim, DRIVER))
    assert len(allocated) == 2
    beta, alpha = documents(kube.wait_pod_log(e2e.cluster, pod.name, "\nnamed-end"), "named")
    assert (beta["apiVersion"], alpha["apiVersion"]) == (
        "metadata.resource.k8s.io/v1beta1",
        "metadata.resource.k8s.io/v1alpha1",
    )
    assert beta["metadata"]["name"] == name and beta["metadata"]["uid"] == claim["metadata"]["uid"]
    (request,) = beta["requests"]
    assert request["name"] == "npu"
    assert sorted(d["name"] for d in request["devices"]) == allocated
    for device in request["devices"]:
        assert (device["driver"], device["pool"]) == (DRIVER, NODE_NAME)
        assert device["attributes"] == attributes[device["name"]], "the file says what the slice publishes"
    kube.wait_pod_phase(e2e.cluster, templated.name, "Running")
    (tmpl, _) = documents(kube.wait_pod_log(e2e.cluster, templated.name, "\ntmpl-end"), "tmpl")
    assert tmpl["podClaimName"] == "devices"
    tmpl_claim = dra.pod_claim(e2e.cluster, templated.name)
    assert [d["name"] for d in tmpl["requests"][0]["devices"]] == dra.allocated_devices(tmpl_claim, DRIVER)

    # status.devices: one entry per allocated device, with what the device is.
    def reported() -> list[dict[str, Any]] | None:
        entries = ours(e2e.cluster.kubectl_json("get", "resourceclaim", name, "-n", "default"))
        return entries if sorted(d["device"] for d in entries) == allocated else None

    entries = kube.wait_until("kxpu's entries in the claim's status.devices", reported, 30)
    for entry in entries:
        assert entry["pool"] == NODE_NAME
        uuid = attributes[entry["device"]]["uuid"]["string"]
        assert entry["data"]["uuid"] == uuid and entry["data"]["model"] == "sim-npu"
        assert entry["data"]["memoryMiB"] == 16384 and entry["data"]["health"] == "Healthy"
        ready = {c["type"]: c for c in entry["conditions"]}["Ready"]
        assert (ready["status"], ready["reason"]) == ("True", "Prepared")
    managers = {m["manager"] for m in e2e.cluster.kubectl_json(
        "get", "resourceclaim", name, "-n", "default", "--show-managed-fields"
    )["metadata"]["managedFields"]}  # fmt: skip
    assert f"kxpu-{DRIVER}" in managers

    # The pod ends; the claim stays allocated (a second consumer holds it): kxpu's unprepare removes the entries.
    e2e.cluster.kubectl(
        "patch", "resourceclaim", name, "-n", "default", "--subresource=status", "--type=json",
        "-p", json.dumps([{"op": "add", "path": "/status/reservedFor/-", "value": KEEPER}]),
    )  # fmt: skip

    def release() -> None:
        """Before the claim is deleted: its allocation and finalizer go as the claim controller would take them
        (it deallocates only when it removes the last consumer itself)."""
        k = e2e.cluster.kubectl
        k("patch", "resourceclaim", name, "-n", "default", "--subresource=status", "--type=merge",
          "-p", json.dumps({"status": {"reservedFor": None, "allocation": None}}), check=False)  # fmt: skip
        k("patch", "resourceclaim", name, "-n", "default", "--type=merge",
          "-p", json.dumps({"metadata": {"finalizers": None}}), check=False)  # fmt: skip

    e2e.cleanups.append(release)  # runs before the claim's deletion (cleanups run last added first)
    e2e.cluster.kubectl("delete", "pod", pod.name, "-n", "default", "--wait=true", "--timeout=60s")

    def cleared() -> dict[str, Any] | None:
        claim = e2e.cluster.kubectl_json("get", "resourceclaim", name, "-n", "default")
        return claim if not ours(claim) else None

    claim = kube.wait_until("kxpu's entries gone from the claim's status.devices", cleared, 60)
    assert dra.allocated_devices(claim, DRIVER) == allocated, (
        "the claim is still allocated: kxpu removed them"
    )
    assert KEEPER in claim["status"]["reservedFor"]
