"""The chart as users consume a release: the released image at the chart's appVersion, the Kubernetes versions it
supports (kubeVersion; DRA refuses an older server in one line), kube-scheduler following the cluster, and
`make chart`'s packaged archive."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import yaml

from deploy.tests.conftest import CHART, REPO, template, template_error

SHARING = ("-f", str(Path(__file__).parent / "values-sharing.yaml"))
DRA = ("-f", str(REPO / "examples" / "dra" / "chart-values.yaml"))


def version() -> str:
    text: str = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    return text


def images(helm: Path, *args: str) -> dict[str, str]:
    r = template(helm, *args)
    out = {}
    for kind in ("DaemonSet", "Deployment"):
        for doc in r.kinds(kind):
            for c in doc["spec"]["template"]["spec"]["containers"]:
                out[f"{doc['metadata']['name']}/{c['name']}"] = c["image"]
    return out


def test_default_image_is_the_release_at_app_version(helm: Path) -> None:
    """Not a local name: a bare install pulls the released image, at the version the chart was released with."""
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["version"] == chart["appVersion"] == version()
    found = images(helm, *SHARING)
    assert found and set(found.values()) - {i for i in found.values() if "kube-scheduler" in i} == {
        f"ghcr.io/kxpu/kxpu:{version()}"
    }, found
    mirrored = images(helm, "--set", "image.repository=registry.example.com/kxpu/kxpu")
    assert set(mirrored.values()) == {f"registry.example.com/kxpu/kxpu:{version()}"}


def test_kube_version_is_the_oldest_supported(helm: Path) -> None:
    """1.34 is the oldest release the e2e suite runs (Makefile OLDEST_K8S); older servers are refused by helm."""
    oldest = re.search(r"^OLDEST_K8S := (\S+)$", (REPO / "Makefile").read_text(), re.M)
    assert oldest is not None
    assert yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"] == f">={oldest.group(1)}.0-0"
    template(helm, "--kube-version", f"{oldest.group(1)}.0")
    error = template_error(helm, "--kube-version", "1.33.5")
    assert "chart requires kubeVersion: >=1.34.0-0 which is incompatible with Kubernetes v1.33.5" in error


def test_dra_refuses_an_older_server_in_one_line(helm: Path, tmp_path: Path) -> None:
    """Were the chart's kubeVersion loosened (or the cluster's resource.k8s.io/v1 off), the DRA templates refuse
    with what to do instead of objects the server cannot take."""
    chart = tmp_path / "kxpu"
    shutil.copytree(CHART, chart)
    meta = chart / "Chart.yaml"
    meta.write_text(re.sub(r"^kubeVersion: .*$", 'kubeVersion: ">=1.20.0-0"', meta.read_text(), flags=re.M))
    proc = subprocess.run(
        [str(helm), "template", "kxpu", str(chart), *DRA, "--kube-version", "1.33.2"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0
    (line,) = [ln for ln in proc.stderr.splitlines() if "serve: dra" in ln]
    assert line.endswith(
        "serve: dra needs Kubernetes 1.34 or newer with the resource.k8s.io/v1 API (DRA); this cluster is "
        "v1.33.2: serve these resources as device plugins (serve: devicePlugin) or upgrade the cluster"
    ), line
    # Device plugins alone still render there, and DRA renders on 1.34.
    ok = subprocess.run(
        [str(helm), "template", "kxpu", str(chart), "--kube-version", "1.33.2"],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0, ok.stderr
    assert template(helm, *DRA, "--kube-version", "1.34.0").kinds("DeviceClass")


def test_kube_scheduler_follows_the_cluster_unless_pinned(helm: Path) -> None:
    key = "kxpu-scheduler/kube-scheduler"
    assert images(helm, *SHARING, "--kube-version", "1.35.3")[key] == "registry.k8s.io/kube-scheduler:v1.35.3"
    # A provider's suffix is not a tag registry.k8s.io has.
    assert (
        images(helm, *SHARING, "--kube-version", "v1.36.1-eks-4f1c2e")[key]
        == "registry.k8s.io/kube-scheduler:v1.36.1"
    )
    pinned = images(
        helm, *SHARING, "--kube-version", "1.35.3", "--set", "scheduler.kubeScheduler.image.tag=v1.34.4"
    )
    assert pinned[key] == "registry.k8s.io/kube-scheduler:v1.34.4"


def test_make_chart_packages_an_installable_archive(helm: Path, tmp_path: Path) -> None:
    """`make chart` (hack/helm/package.sh): a .tgz named for the version that renders as the directory does."""
    env = {**os.environ, "KXPU_CHART_OUT": str(tmp_path), "KXPU_HELM": str(helm)}
    proc = subprocess.run(
        ["bash", str(REPO / "hack" / "helm" / "package.sh")], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, proc.stderr
    archive = Path(proc.stdout.strip())
    assert archive == tmp_path / f"kxpu-{version()}.tgz" and archive.is_file()
    shown = subprocess.run(
        [str(helm), "show", "chart", str(archive)], capture_output=True, text=True, check=True
    )
    assert yaml.safe_load(shown.stdout)["appVersion"] == version()
    packaged = subprocess.run(
        [str(helm), "template", "kxpu", str(archive), "--namespace", "kxpu-system"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert (
        packaged
        == subprocess.run(
            [str(helm), "template", "kxpu", str(CHART), "--namespace", "kxpu-system"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )


def test_package_refuses_a_chart_version_apart_from_kxpu(helm: Path, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "deploy" / "helm").mkdir(parents=True)
    (repo / "hack" / "helm").mkdir(parents=True)
    shutil.copytree(CHART, repo / "deploy" / "helm" / "kxpu")
    shutil.copy(REPO / "hack" / "helm" / "package.sh", repo / "hack" / "helm" / "package.sh")
    (repo / "pyproject.toml").write_text('[project]\nversion = "9.9.9"\n')
    env = {**os.environ, "KXPU_CHART_OUT": str(tmp_path / "out"), "KXPU_HELM": str(helm)}
    proc = subprocess.run(
        ["bash", str(repo / "hack" / "helm" / "package.sh")], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().endswith("kxpu is 9.9.9 (pyproject.toml): set both to 9.9.9"), proc.stderr
