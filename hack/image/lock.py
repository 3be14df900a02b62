"""Pin the image's Python packages: exact versions and the sha256 of every wheel, for amd64 and arm64.

The image runs Debian bookworm's python3 (3.11), so wheels are resolved for that interpreter and glibc, not for
the machine running this script. Both image builds (``Dockerfile`` and ``hack/image/build.sh``) install with
``--require-hashes`` from the files written here, so an image holds exactly what was reviewed.

    python hack/image/lock.py           # re-resolve and rewrite the lock files (network: PyPI)
    python hack/image/lock.py --check   # exit 1 if pyproject's runtime dependencies changed since the lock
    python hack/image/lock.py --download DIR [--arch ARCH]   # the locked wheels (and pip), hashes checked

The runtime dependencies are ``[project].dependencies`` plus every optional group except ``dev`` (the image
holds every component). Their digest is recorded in the lock's header, which is what ``--check`` compares.

The development environment (``make dev``) is locked the same way in ``hack/dev-requirements.txt``:
``[project].dependencies``, the ``dev`` group, the build requirements (kxpu is installed editable without build
isolation) and pip, resolved for CPython 3.11 on Linux, each pin carrying the sha256 of every wheel of that
version for CPython 3.11 to 3.15 on Linux and macOS (from the index's JSON API), and checked to install on each of
those Pythons.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
LOCK = HERE / "requirements.txt"
INSTALLER_LOCK = HERE / "installer.txt"
PYTHON_VERSION = "3.11"  # Debian bookworm's python3
GLIBC_MINOR = 36  # bookworm's glibc 2.36
ARCHES = {"amd64": "x86_64", "arm64": "aarch64"}
HEADER = "# inputs sha256: "
DEV_LOCK = REPO / "hack" / "dev-requirements.txt"
DEV_PYTHONS = ("3.11", "3.12", "3.13", "3.14", "3.15")  # requires-python's floor to the newest CI runs


def runtime_requirements(pyproject: Path = REPO / "pyproject.toml") -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    reqs = list(project.get("dependencies", []))
    for group, extra in sorted(project.get("optional-dependencies", {}).items()):
        if group != "dev":
            reqs += extra
    return sorted(set(reqs))


def inputs_digest(reqs: list[str]) -> str:
    return hashlib.sha256(("\n".join(reqs) + f"\npython {PYTHON_VERSION}\n").encode()).hexdigest()


def dev_requirements(pyproject: Path = REPO / "pyproject.toml") -> list[str]:
    """What ``make dev`` installs: kxpu's dependencies, the dev group, the build requirements and pip."""
    data = tomllib.loads(pyproject.read_text())
    project = data["project"]
    reqs = [*project.get("dependencies", []), *project.get("optional-dependencies", {}).get("dev", [])]
    return sorted({*reqs, *data["build-system"]["requires"], "pip"})


def dev_inputs_digest(reqs: list[str]) -> str:
    return hashlib.sha256(("\n".join(reqs) + f"\npythons {' '.join(DEV_PYTHONS)}\n").encode()).hexdigest()


def recorded_digest(lock: Path = LOCK) -> str | None:
    if not lock.exists():
        return None
    for line in lock.read_text().splitlines():
        if line.startswith(HEADER):
            return line.removeprefix(HEADER).strip()
    return None


def platform_tags(arch: str) -> list[str]:
    """The manylinux tags pip inside the image accepts, most specific first (pip --platform does not expand
    ``manylinux_2_36`` to the older glibc versions it covers)."""
    tags = [f"manylinux_2_{minor}_{arch}" for minor in range(GLIBC_MINOR, 4, -1)]
    return [*tags, f"manylinux2014_{arch}", f"manylinux2010_{arch}", f"manylinux1_{arch}"]


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def download(reqs: list[str], arch: str, dest: Path, no_deps: bool = False) -> dict[str, tuple[str, str]]:
    """Resolve ``reqs`` for the image's interpreter on ``arch``; {name: (version, sha256)} of the wheels."""
    platforms = [arg for tag in platform_tags(arch) for arg in ("--platform", tag)]
    argv = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-cache-dir",
            "--only-binary=:all:", *platforms, "--python-version", PYTHON_VERSION,
            "--implementation", "cp", "--abi", f"cp{PYTHON_VERSION.replace('.', '')}", "--dest", str(dest)]  # fmt: skip
    if no_deps:
        argv.append("--no-deps")
    # Only index files are pinned (a local --find-links directory could hold other builds of the same version).
    subprocess.run([*argv, *reqs], check=True, env={**os.environ, "PIP_FIND_LINKS": ""})
    found: dict[str, tuple[str, str]] = {}
    for wheel in sorted(dest.glob("*.whl")):
        name, version = wheel.name.split("-")[:2]
        found[_canonical(name)] = (version, hashlib.sha256(wheel.read_bytes()).hexdigest())
    return found


def download_locked(dest: Path, arch: str) -> None:
    """Fetch exactly the locked wheels for the image's interpreter on ``arch``; pip checks every hash."""
    platforms = [arg for tag in platform_tags(arch) for arg in ("--platform", tag)]
    for lock in (LOCK, INSTALLER_LOCK):
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
             "--require-hashes", "--only-binary=:all:", *platforms, "--python-version", PYTHON_VERSION,
             "--implementation", "cp", "--abi", f"cp{PYTHON_VERSION.replace('.', '')}", "--dest", str(dest),
             "-r", str(lock)],
            check=True,
            env={**os.environ, "PIP_FIND_LINKS": ""},
        )  # fmt: skip


def render(pins: dict[str, tuple[str, set[str]]], digest: str | None, what: str) -> str:
    lines = [
        f"# {what}",
        "# Generated by hack/image/lock.py (make image-lock); do not edit. Wheels for CPython "
        f"{PYTHON_VERSION}, glibc 2.{GLIBC_MINOR}, {' and '.join(ARCHES.values())}.",
    ]
    if digest:
        lines.append(HEADER + digest)
    for name in sorted(pins):
        version, hashes = pins[name]
        lines.append(f"{name}=={version} \\")
        lines += [f"    --hash=sha256:{h} \\" for h in sorted(hashes)]
        lines[-1] = lines[-1].removesuffix(" \\")
    return "\n".join(lines) + "\n"


def dry_run(args: list[str], python: str, arch: str) -> dict[str, str]:
    """What pip would install for CPython ``python`` on Linux ``arch`` (wheels only): {name: version}."""
    platforms = [arg for tag in platform_tags(arch) for arg in ("--platform", tag)]
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report", "-",
         "--disable-pip-version-check", "--only-binary=:all:", *platforms, "--python-version", python,
         "--implementation", "cp", "--abi", f"cp{python.replace('.', '')}", *args],
        check=True, capture_output=True, text=True, env={**os.environ, "PIP_FIND_LINKS": ""},
    )  # fmt: skip
    report = json.loads(proc.stdout)
    return {_canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in report["install"]}


def _dev_wheel(filename: str, version: str) -> bool:
    """A wheel of ``version`` that ``make dev`` may pick: CPython 3.11+ (or pure Python), Linux glibc or macOS."""
    from packaging.utils import InvalidWheelFilename, canonicalize_version, parse_wheel_filename

    try:
        _, found, _, tags = parse_wheel_filename(filename)
    except InvalidWheelFilename:  # old uploads with names pip ignores too
        return False
    if canonicalize_version(found) != canonicalize_version(version):
        return False
    pythons = {f"cp{v.replace('.', '')}" for v in DEV_PYTHONS}
    for tag in tags:
        platform_ok = tag.platform == "any" or tag.platform.startswith(("manylinux", "macosx"))
        python_ok = tag.interpreter.startswith("py3") or tag.interpreter in pythons or tag.abi == "abi3"
        if platform_ok and python_ok:
            return True
    return False


def wheel_hashes(name: str, version: str) -> set[str]:
    """The sha256 of every wheel of ``name==version`` on PyPI that a dev machine may pick (the index's JSON
    simple API, PEP 691, as pip reads it)."""
    request = urllib.request.Request(
        f"https://pypi.org/simple/{name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(request, timeout=60) as resp:
        files = json.load(resp)["files"]
    hashes = {
        f["hashes"]["sha256"]
        for f in files
        if f["filename"].endswith(".whl") and _dev_wheel(f["filename"], version)
    }
    if not hashes:
        raise SystemExit(f"{name}=={version} has no wheel for CPython {DEV_PYTHONS[0]}+ on Linux or macOS")
    return hashes


def resolve_dev(reqs: list[str]) -> dict[str, tuple[str, set[str]]]:
    versions: dict[str, str] = {}
    for arch in ARCHES.values():
        for name, version in dry_run(reqs, DEV_PYTHONS[0], arch).items():
            if versions.setdefault(name, version) != version:
                raise SystemExit(
                    f"{name} resolves to {versions[name]} and {version} on different architectures"
                )
    return {name: (version, wheel_hashes(name, version)) for name, version in versions.items()}


def check_dev_lock(lock: Path = DEV_LOCK) -> None:
    """Every Python of DEV_PYTHONS can install exactly the lock (wheels exist, hashes match)."""
    for python in DEV_PYTHONS:
        for arch in ARCHES.values():
            try:
                dry_run(["--no-deps", "--require-hashes", "-r", str(lock)], python, arch)
            except subprocess.CalledProcessError as exc:
                raise SystemExit(
                    f"{lock.name} does not install on CPython {python} {arch}: {exc.stderr}"
                ) from None


def write_dev_lock(reqs: list[str], digest: str) -> None:
    text = render(resolve_dev(reqs), digest, "Python packages of the development environment (make dev)")
    wheels = f"Wheels for CPython {PYTHON_VERSION}, glibc 2.{GLIBC_MINOR}, {' and '.join(ARCHES.values())}."
    dev = f"Resolved for CPython {DEV_PYTHONS[0]}; wheels for CPython {', '.join(DEV_PYTHONS)}, Linux and macOS."
    DEV_LOCK.write_text(text.replace(wheels, dev))
    check_dev_lock()


def resolve(reqs: list[str], no_deps: bool = False) -> dict[str, tuple[str, set[str]]]:
    pins: dict[str, tuple[str, set[str]]] = {}
    for arch in ARCHES.values():
        with tempfile.TemporaryDirectory(prefix=f"kxpu-lock-{arch}-") as tmp:
            for name, (version, sha) in download(reqs, arch, Path(tmp), no_deps).items():
                known = pins.setdefault(name, (version, set()))
                if known[0] != version:
                    raise SystemExit(
                        f"{name} resolves to {known[0]} and {version} on different architectures"
                    )
                known[1].add(sha)
    return pins


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="only check the lock matches pyproject.toml")
    parser.add_argument("--download", type=Path, metavar="DIR", help="download the locked wheels into DIR")
    parser.add_argument("--arch", default=os.uname().machine, choices=sorted(ARCHES.values()))
    parser.add_argument("--dev", action="store_true", help="rewrite only the development lock")
    args = parser.parse_args()
    if args.download:
        download_locked(args.download, args.arch)
        return 0
    reqs = runtime_requirements()
    digest = inputs_digest(reqs)
    dev_reqs = dev_requirements()
    dev_digest = dev_inputs_digest(dev_reqs)
    if args.check:
        if recorded_digest() != digest:
            print(
                f"{LOCK.relative_to(REPO)} is stale: pyproject.toml's runtime dependencies changed; "
                "run `make image-lock`",
                file=sys.stderr,
            )
            return 1
        if recorded_digest(DEV_LOCK) != dev_digest:
            print(
                f"{DEV_LOCK.relative_to(REPO)} is stale: pyproject.toml's dev or build dependencies changed; "
                "run `make image-lock`",
                file=sys.stderr,
            )
            return 1
        return 0
    if args.dev:
        write_dev_lock(dev_reqs, dev_digest)
        print(f"wrote {DEV_LOCK.relative_to(REPO)}")
        return 0
    LOCK.write_text(render(resolve(reqs), digest, "Python packages of the kxpu image (runtime dependencies)"))
    # pip itself only installs into the image; it is not left there.
    INSTALLER_LOCK.write_text(render(resolve(["pip"], no_deps=True), None, "pip, used to install the image"))
    write_dev_lock(dev_reqs, dev_digest)
    print(
        f"wrote {LOCK.relative_to(REPO)}, {INSTALLER_LOCK.relative_to(REPO)} and {DEV_LOCK.relative_to(REPO)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
