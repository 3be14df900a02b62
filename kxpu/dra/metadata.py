"""Device metadata in the container (KEP-5304, beta in Kubernetes 1.37): each request's devices and their
attributes as a file the container reads, without a vendor tool.

There is no kubelet side: the driver writes the file and a CDI spec that bind-mounts it read-only, and adds
that CDI device to its NodePrepareResources answer (on the request's first device), as the upstream helper
(``k8s.io/dynamic-resource-allocation/kubeletplugin``, ``EnableDeviceMetadata``) does. Opt-in there, opt-in
here (``dra.deviceMetadata``). The names and layout are upstream's (``api/metadata``):

- in the container: ``/var/run/kubernetes.io/dra-device-attributes/resourceclaims/<claim>/<request>/
  <driver>-metadata.json`` for a claim the pod names, ``.../resourceclaimtemplates/<pod claim name>/<request>/
  <driver>-metadata.json`` for one made from a template (its ``resource.kubernetes.io/pod-claim-name``
  annotation: the generated claim name is unknown when the pod spec is written);
- on the host: ``<plugins dir>/<driver>/dra-device-metadata/<namespace>_<claim>/<request>/metadata.json``;
  the CDI spec ``<cdi dir>/<driver>_metadata_<claim UID>_<request>.json``, kind ``<driver>/metadata``,
  device ``<claim UID>_<request>``;
- the file is a JSON stream: the same ``DeviceMetadata`` object once per API version, newest first
  (``metadata.resource.k8s.io/v1beta1``, then ``v1alpha1`` for 1.36 readers); a reader takes the first it knows.

The attributes are those the ResourceSlice publishes for the device (a partition's as made for the claim: its
own UUID), and for a share what it was granted.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kxpu.atomicfile import write_atomically
from kxpu.cdi.spec import InvalidSpec, qualified_name, write_device_spec
from kxpu.dra.names import is_dns_label, parent_request
from kxpu.model import ContainerEdits, Mount

CONTAINER_DIR = "/var/run/kubernetes.io/dra-device-attributes"
CLAIMS_SUBDIR = "resourceclaims"
TEMPLATES_SUBDIR = "resourceclaimtemplates"
FILE_SUFFIX = "-metadata.json"
HOST_SUBDIR = "dra-device-metadata"
GROUP = "metadata.resource.k8s.io"
VERSIONS = ("v1beta1", "v1alpha1")  # newest first
POD_CLAIM_NAME = "resource.kubernetes.io/pod-claim-name"  # set on claims made from a pod's template
CDI_CLASS = "metadata"


@dataclass(frozen=True, slots=True)
class MetadataDevice:
    """One device of a request, as the container is told about it."""

    request: str  # the request as allocated: "gpu" or "gpu/a100" (a firstAvailable subrequest)
    pool: str
    device: str
    attributes: Mapping[str, Mapping[str, Any]]


def container_path(driver: str, claim_name: str, pod_claim_name: str | None, request: str) -> str:
    if pod_claim_name:
        return f"{CONTAINER_DIR}/{TEMPLATES_SUBDIR}/{pod_claim_name}/{request}/{driver}{FILE_SUFFIX}"
    return f"{CONTAINER_DIR}/{CLAIMS_SUBDIR}/{claim_name}/{request}/{driver}{FILE_SUFFIX}"


def pod_claim_name(claim: Mapping[str, Any]) -> str | None:
    annotations = (claim.get("metadata") or {}).get("annotations") or {}
    value = annotations.get(POD_CLAIM_NAME)
    # Set by the resourceclaim controller to the pod's claim name (a DNS label); anyone may write a claim by hand,
    # so anything else stays out of the container path (../ would climb out of the metadata directory).
    return str(value) if isinstance(value, str) and is_dns_label(value) else None


def document(
    namespace: str,
    name: str,
    uid: str,
    pod_claim: str | None,
    request: str,
    driver: str,
    devices: Sequence[MetadataDevice],
) -> str:
    """The file's content: the object once per version, one JSON document a line."""
    body: dict[str, Any] = {
        "metadata": {"name": name, "namespace": namespace, "uid": uid, "generation": 1},
    }
    if pod_claim:
        body["podClaimName"] = pod_claim
    body["requests"] = [
        {
            "name": request,
            "devices": [
                {"driver": driver, "pool": d.pool, "name": d.device, "attributes": dict(d.attributes)}
                for d in devices
            ],
        }
    ]
    return "".join(
        json.dumps({"kind": "DeviceMetadata", "apiVersion": f"{GROUP}/{v}", **body}, separators=(",", ":"))
        + "\n"
        for v in VERSIONS
    )


class MetadataWriter:
    """Writes and removes one driver's metadata files and their CDI specs."""

    def __init__(self, driver: str, plugin_dir: Path, cdi_dir: Path) -> None:
        self.driver = driver
        self.root = plugin_dir / HOST_SUBDIR
        self.cdi_dir = cdi_dir
        self.kind = f"{driver}/{CDI_CLASS}"

    def claim_dir(self, namespace: str, name: str) -> Path:
        return self.root / f"{namespace}_{name}"

    def spec_path(self, uid: str, request: str) -> Path:
        return self.cdi_dir / f"{self.driver}_metadata_{uid}_{request}.json"

    def write(
        self,
        namespace: str,
        name: str,
        uid: str,
        pod_claim: str | None,
        devices: Sequence[MetadataDevice],
    ) -> dict[str, str]:
        """One file and one CDI spec per request; returns request → the CDI device ID that mounts its file.
        Raises OSError (the caller removes what was written, ``remove``)."""
        by_request: dict[str, list[MetadataDevice]] = {}
        for d in devices:
            by_request.setdefault(parent_request(d.request), []).append(d)
        ids: dict[str, str] = {}
        for base, members in by_request.items():
            # The request as allocated ("gpu/a100": the firstAvailable subrequest chosen) in the content, the
            # request the pod names in the paths.
            request = members[0].request
            host = self.claim_dir(namespace, name) / base / "metadata.json"
            write_atomically(host, document(namespace, name, uid, pod_claim, request, self.driver, members))
            cdi_name = f"{uid}_{base}"
            mount = Mount(container_path(self.driver, name, pod_claim, base), str(host), read_only=True)
            try:
                write_device_spec(
                    self.spec_path(uid, base), self.kind, [(cdi_name, ContainerEdits(mounts=[mount]))]
                )
            except InvalidSpec as exc:
                raise OSError(f"the metadata mount makes an invalid CDI spec: {exc}") from None
            ids[base] = qualified_name(self.kind, cdi_name)
        return ids

    def requests_of(self, cdi_device_ids: Iterable[str]) -> list[str]:
        """The requests whose metadata a claim's CDI device IDs mount (from its checkpoint entry)."""
        prefix = f"{self.kind}="
        return [
            i[len(prefix) :].split("_", 1)[1] for i in cdi_device_ids if i.startswith(prefix) and "_" in i
        ]

    def remove(self, namespace: str, name: str, uid: str, requests: Iterable[str]) -> None:
        """Everything written for the claim (by UID: a claim of the same name made since keeps its files);
        nothing there is not an error."""
        for request in requests:
            self.spec_path(uid, request).unlink(missing_ok=True)
        claim_dir = self.claim_dir(namespace, name)
        if not claim_dir.is_dir():
            return
        for request_dir in claim_dir.iterdir():
            if _file_uid(request_dir / "metadata.json") in (uid, None):
                shutil.rmtree(request_dir, ignore_errors=True)
        with contextlib.suppress(OSError):
            claim_dir.rmdir()  # only once empty

    def orphans(self, known_uids: set[str]) -> list[Path]:
        """CDI specs of claims not in ``known_uids`` (a crash between writing them and the checkpoint)."""
        prefix = f"{self.driver}_metadata_"
        out = []
        try:
            candidates = list(self.cdi_dir.glob(f"{prefix}*.json"))
        except OSError:
            return []
        for path in candidates:
            uid = path.name[len(prefix) :].split("_", 1)[0]
            if uid not in known_uids:
                out.append(path)
        return out

    def remove_orphan(self, spec: Path) -> None:
        """An orphaned CDI spec and the file it mounts (found through the spec, only under this driver's
        directory)."""
        try:
            mounts = json.loads(spec.read_text())["devices"][0]["containerEdits"]["mounts"]
            host = Path(mounts[0]["hostPath"])
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            host = None
        spec.unlink(missing_ok=True)
        # only the shape this writer makes, <root>/<namespace>_<claim>/<request>/metadata.json, with no '..'
        # climbing out of it (a lexical is_relative_to would let root/../../etc through)
        if (
            host is not None
            and host.is_absolute()
            and ".." not in host.parts
            and host.parent.parent.parent == self.root
            and host.name == "metadata.json"
        ):
            shutil.rmtree(host.parent, ignore_errors=True)
            with contextlib.suppress(OSError):
                host.parent.parent.rmdir()


def _file_uid(path: Path) -> str | None:
    """The claim UID a metadata file was written for; None when it cannot be read."""
    try:
        with path.open() as f:
            return str(json.loads(f.readline())["metadata"]["uid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
