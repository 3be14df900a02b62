"""Write small OCI image archives from local files, so the e2e cluster needs no registry.

An archive is an OCI image layout (``oci-layout``, ``index.json``, ``blobs/sha256/*``) in one tar, which
``ctr images import`` reads. Each image has one uncompressed layer built deterministically (fixed mtimes and
owners), so the same inputs give the same digests and containerd can skip unchanged content.
"""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

ARCH = "amd64"
_NAME_ANNOTATION = "io.containerd.image.name"  # full reference, what containerd names the imported image
_REF_ANNOTATION = "org.opencontainers.image.ref.name"


@dataclass
class Layer:
    """Files of a single image layer: regular files copied from the host, symlinks and empty directories."""

    files: dict[str, tuple[Path, int]] = field(default_factory=dict)  # image path -> (host file, mode)
    symlinks: dict[str, str] = field(default_factory=dict)  # image path -> target
    dirs: dict[str, int] = field(default_factory=dict)  # image path -> mode

    def tar(self) -> bytes:
        """The layer as an uncompressed tar; parents are created before their children."""
        entries: dict[str, tarfile.TarInfo] = {}
        payload: dict[str, bytes] = {}

        def add_parents(path: str) -> None:
            parts = path.strip("/").split("/")[:-1]
            for i in range(1, len(parts) + 1):
                d = "/".join(parts[:i])
                if d not in entries:
                    entries[d] = _info(d, tarfile.DIRTYPE, 0o755)

        for path, mode in self.dirs.items():
            add_parents(path)
            entries[path.strip("/")] = _info(path.strip("/"), tarfile.DIRTYPE, mode)
        for path, (host, mode) in self.files.items():
            add_parents(path)
            data = host.read_bytes()
            info = _info(path.strip("/"), tarfile.REGTYPE, mode)
            info.size = len(data)
            entries[info.name] = info
            payload[info.name] = data
        for path, target in self.symlinks.items():
            add_parents(path)
            info = _info(path.strip("/"), tarfile.SYMTYPE, 0o777)
            info.linkname = target
            entries[info.name] = info

        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for name in sorted(entries):
                content = payload.get(name)
                tar.addfile(entries[name], io.BytesIO(content) if content is not None else None)
        return buf.getvalue()


def _info(name: str, kind: bytes, mode: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = mode
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def _blob(blobs: dict[str, bytes], data: bytes) -> tuple[str, int]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    blobs[digest] = data
    return digest, len(data)


def write_archive(out: Path, ref: str, layer: Layer, config: Mapping[str, object]) -> str:
    """Write an OCI layout tar for image ``ref`` (``name:tag``) and return its manifest digest.

    ``config`` is the image's runtime config (``Entrypoint``, ``Cmd``, ``Env``, ``WorkingDir``).
    """
    blobs: dict[str, bytes] = {}
    layer_tar = layer.tar()
    layer_digest, layer_size = _blob(blobs, layer_tar)
    image_config = {
        "architecture": ARCH,
        "os": "linux",
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},  # uncompressed: diff ID == digest
        "history": [{"created_by": "kxpu e2e/oci.py", "created": "1970-01-01T00:00:00Z"}],
        "created": "1970-01-01T00:00:00Z",
    }
    config_digest, config_size = _blob(blobs, _json(image_config))
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": config_digest,
            "size": config_size,
        },
        "layers": [
            {
                "mediaType": "application/vnd.oci.image.layer.v1.tar",
                "digest": layer_digest,
                "size": layer_size,
            }
        ],
    }
    manifest_digest, manifest_size = _blob(blobs, _json(manifest))
    tag = ref.rsplit(":", 1)[1] if ":" in ref.rsplit("/", 1)[-1] else "latest"
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": manifest_digest,
                "size": manifest_size,
                "platform": {"architecture": ARCH, "os": "linux"},
                "annotations": {_NAME_ANNOTATION: ref, _REF_ANNOTATION: tag},
            }
        ],
    }
    files = {"oci-layout": _json({"imageLayoutVersion": "1.0.0"}), "index.json": _json(index)}
    for digest, data in blobs.items():
        files["blobs/sha256/" + digest.split(":", 1)[1]] = data
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w") as tar:
        for name in ["blobs", "blobs/sha256"]:
            tar.addfile(_info(name, tarfile.DIRTYPE, 0o755))
        for name, data in sorted(files.items()):
            info = _info(name, tarfile.REGTYPE, 0o644)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return manifest_digest


def _json(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def pause_image(out: Path, ref: str, pause_binary: Path) -> str:
    """The pod sandbox image: just the static ``pause`` binary built with the cluster."""
    layer = Layer(files={"/pause": (pause_binary, 0o755)})
    return write_archive(out, ref, layer, {"Entrypoint": ["/pause"], "User": "65535:65535"})


def busybox_image(out: Path, ref: str, busybox: Path = Path("/usr/bin/busybox")) -> str:
    """A shell image for test pods from Debian's static busybox, with a symlink for every applet."""
    applets = subprocess.run([str(busybox), "--list"], check=True, capture_output=True, text=True).stdout
    layer = Layer(
        files={"/bin/busybox": (busybox, 0o755)},
        symlinks={f"/bin/{name}": "busybox" for name in applets.split() if name != "busybox"},
        dirs={"/tmp": 0o1777, "/etc": 0o755, "/proc": 0o555, "/sys": 0o555, "/dev": 0o755, "/root": 0o700},
    )
    config = {"Cmd": ["sh"], "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]}
    return write_archive(out, ref, layer, config)


def binary_image(out: Path, ref: str, binary: Path) -> str:
    """An image of one static binary at ``/usr/local/bin/<name>``, on ``PATH`` (e.g. kube-scheduler)."""
    layer = Layer(files={f"/usr/local/bin/{binary.name}": (binary, 0o755)}, dirs={"/tmp": 0o1777})
    config = {"Cmd": [binary.name], "Env": ["PATH=/usr/local/bin:/usr/bin:/bin"]}
    return write_archive(out, ref, layer, config)
