"""The whole sharing chain on the e2e harness cluster (`python -m e2e.cluster up` first), as a person would run it.

kube-scheduler (a second one, schedulerName kxpu-smoke) -> kxpu scheduler (extender) -> bind with signed
assignment -> kubelet -> kxpu plugin (sharing wrapper) -> env in the container. The webhook is scoped to our
namespace and trusts the admin user (the extender here runs with the same identity as kubectl, so a pod
created with kxpu annotations is checked on the node instead, in a namespace without the webhook).
Run as root: `.venv/bin/python examples/sharing/smoke.py`; it cleans up after itself.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trustme
import yaml

REPO = Path("/work/main")
KUBECONFIG = "/var/lib/kxpu-e2e/admin.kubeconfig"
BIN = Path("/var/cache/kxpu/k8s-v1.34.4/bin")
NS = "kxpu-smoke"
RES = "smoke.kxpu.io/npu"
NODE = "kxpu-e2e"
WORK = Path(tempfile.mkdtemp(prefix="kxpu-smoke-"))
ENV = dict(os.environ, KUBECONFIG=KUBECONFIG, NODE_NAME=NODE)
procs: list[subprocess.Popen[bytes]] = []


def kubectl(*args: str, input: str | None = None, check: bool = True) -> str:
    out = subprocess.run([str(BIN / "kubectl"), *args], input=input, capture_output=True, text=True, env=ENV)
    if check and out.returncode:
        raise RuntimeError(f"kubectl {' '.join(args)}: {out.stderr}")
    return out.stdout


def start(name: str, *cmd: str) -> None:
    log = open(WORK / f"{name}.log", "wb")  # noqa: SIM115 (the child process keeps it)
    procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=ENV, cwd=REPO))
    print(f"started {name} pid {procs[-1].pid}, log {WORK / (name + '.log')}")


def wait(what: str, check, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while True:
        try:
            if check():
                print(f"ok: {what}")
                return
        except Exception:
            pass
        if time.time() > deadline:
            raise RuntimeError(f"timed out: {what}")
        time.sleep(0.5)


def pod(name: str, limits: dict[str, str], annotations: dict[str, str] | None = None, **spec: object) -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "annotations": annotations or {}},
            "spec": {
                "terminationGracePeriodSeconds": 0,
                "containers": [
                    {
                        "name": "main",
                        "image": "kxpu.local/busybox:v1",
                        "imagePullPolicy": "Never",
                        "command": ["sh", "-c", "env | sort; sleep 3600"],
                        "resources": {"limits": limits},
                    }
                ],
                **spec,
            },
        }
    )


def main() -> None:
    kubectl("create", "namespace", NS)
    kubectl("label", "namespace", NS, "kxpu-smoke=true")
    key = secrets.token_urlsafe(32)
    kubectl("-n", NS, "create", "secret", "generic", "keys", f"--from-literal=keys={key}")

    node_cfg = WORK / "node.yaml"
    node_cfg.write_text(
        yaml.safe_dump(
            {
                "version": "v1",
                "resources": [
                    {
                        "name": RES,
                        "simulated": {"count": 2, "model": "snpu", "memoryMiB": 16000, "cores": 64},
                        "sharing": {
                            "splitCount": 4,
                            "signingKey": {"secret": f"{NS}/keys", "hmac": True},
                            "lockNamespace": NS,
                            "publishIntervalSeconds": 5,
                            "visibleDevicesEnv": "NPU_VISIBLE_DEVICES",
                        },
                    }
                ],
            }
        )
    )
    cp_cfg = WORK / "cp.yaml"
    cp_cfg.write_text(
        yaml.safe_dump(
            {
                "version": "v1",
                "families": [{"resource": RES}],
                "schedulerName": "kxpu-smoke",
                "signingKey": {"secret": f"{NS}/keys", "hmac": True},
                "lockNamespace": NS,
            }
        )
    )
    sched_cfg = WORK / "kube-scheduler.yaml"
    sched_cfg.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kubescheduler.config.k8s.io/v1",
                "kind": "KubeSchedulerConfiguration",
                "clientConnection": {"kubeconfig": KUBECONFIG},
                "leaderElection": {"leaderElect": False},
                "profiles": [{"schedulerName": "kxpu-smoke"}],
                "extenders": [
                    {
                        "urlPrefix": "http://127.0.0.1:18888",
                        "filterVerb": "filter",
                        "prioritizeVerb": "prioritize",
                        "bindVerb": "bind",
                        "weight": 1,
                        "nodeCacheCapable": True,
                        "enableHTTPS": False,
                        "managedResources": [{"name": RES, "ignoredByScheduler": False}]
                        + [
                            {"name": RES + s, "ignoredByScheduler": True}
                            for s in ("mem", "mem-percentage", "cores")
                        ],
                    }
                ],
            }
        )
    )
    # webhook certs
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.private_key_pem.write_to_path(str(WORK / "tls.key"))
    cert.cert_chain_pems[0].write_to_path(str(WORK / "tls.crt"))
    kx = str(REPO / ".venv/bin/kxpu")
    start(
        "plugin",
        kx,
        "plugin",
        "--config",
        str(node_cfg),
        "--http-address",
        "127.0.0.1:19400",
        "--log-level",
        "debug",
    )
    start(
        "extender",
        kx,
        "scheduler",
        "--config",
        str(cp_cfg),
        "--address",
        "127.0.0.1:18888",
        "--metrics-address",
        "127.0.0.1:18889",
        "--log-level",
        "debug",
    )
    start(
        "webhook",
        kx,
        "webhook",
        "--config",
        str(cp_cfg),
        "--address",
        "127.0.0.1:18443",
        "--metrics-address",
        "127.0.0.1:18444",
        "--tls-cert-file",
        str(WORK / "tls.crt"),
        "--tls-key-file",
        str(WORK / "tls.key"),
        "--trusted-user",
        "kubernetes-admin",
    )
    start(
        "kube-scheduler",
        str(BIN / "kube-scheduler"),
        "--config",
        str(sched_cfg),
        "--secure-port",
        "10359",
        "--v",
        "2",
    )
    ca_bundle = base64.b64encode(ca.cert_pem.bytes()).decode()
    hooks = []
    for kind, path, ops in (
        ("Mutating", "/mutate", ["CREATE"]),
        ("Validating", "/validate", ["CREATE", "UPDATE"]),
    ):
        hooks.append(
            {
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": f"{kind}WebhookConfiguration",
                "metadata": {"name": "kxpu-smoke"},
                "webhooks": [
                    {
                        "name": f"{kind.lower()}.smoke.kxpu.io",
                        "admissionReviewVersions": ["v1"],
                        "sideEffects": "None",
                        "failurePolicy": "Fail",
                        "timeoutSeconds": 5,
                        "clientConfig": {"url": f"https://127.0.0.1:18443{path}", "caBundle": ca_bundle},
                        "rules": [
                            {
                                "apiGroups": [""],
                                "apiVersions": ["v1"],
                                "operations": ops,
                                "resources": ["pods"],
                            }
                        ],
                        "namespaceSelector": {"matchLabels": {"kxpu-smoke": "true"}},
                    }
                ],
            }
        )
    kubectl("apply", "-f", "-", input=yaml.safe_dump_all(hooks))

    wait(
        "inventory on the node",
        lambda: (
            "kxpu.io/devices.smoke.kxpu.io_npu"
            in kubectl("get", "node", NODE, "-o", "jsonpath={.metadata.annotations}")
        ),
    )
    wait(
        "allocatable 8 slots",
        lambda: (
            kubectl("get", "node", NODE, "-o", "jsonpath={.status.allocatable.smoke\\.kxpu\\.io/npu}") == "8"
        ),
    )
    wait(
        "extender ready",
        lambda: subprocess.run(["curl", "-sf", "http://127.0.0.1:18888/readyz"]).returncode == 0,
    )
    time.sleep(1)

    # 1) two pods: only memory/cores named (the webhook adds the count and the scheduler name)
    for n in (1, 2):
        kubectl("apply", "-f", "-", input=pod(f"share-{n}", {RES + "mem": "6000", RES + "cores": "40"}))
    for n in (1, 2):
        wait(
            f"share-{n} running",
            lambda n=n: (
                kubectl("-n", NS, "get", "pod", f"share-{n}", "-o", "jsonpath={.status.phase}") == "Running"
            ),
            120,
        )
    for n in (1, 2):
        p = json.loads(kubectl("-n", NS, "get", "pod", f"share-{n}", "-o", "json"))
        print(
            f"share-{n}: schedulerName={p['spec']['schedulerName']} limits={p['spec']['containers'][0]['resources']['limits']}"
        )
        print(
            "  annotations:",
            {k: v for k, v in p["metadata"]["annotations"].items() if k.startswith("kxpu.io/")},
        )
        logs = kubectl("-n", NS, "logs", f"share-{n}")
        env = [line for line in logs.splitlines() if line.startswith(("CUDA_", "NPU_", "KXPU_"))]
        print("  env:", env)
        assert "CUDA_DEVICE_MEMORY_LIMIT_0=6000m" in env and "CUDA_DEVICE_SM_LIMIT=40" in env, env
    # 2) a pod that fits no device now: stays Pending with the extender's reason
    kubectl("apply", "-f", "-", input=pod("too-big", {RES: "1", RES + "mem": "12000"}))
    wait(
        "too-big unschedulable",
        lambda: (
            "not enough memory"
            in kubectl(
                "-n",
                NS,
                "get",
                "events",
                "--field-selector",
                "involvedObject.name=too-big",
                "-o",
                "jsonpath={.items[*].message}",
            )
        ),
        60,
    )
    print(
        "too-big events:",
        kubectl(
            "-n",
            NS,
            "get",
            "events",
            "--field-selector",
            "involvedObject.name=too-big",
            "-o",
            "jsonpath={.items[*].message}",
        )[:400],
    )
    # 3) the webhook refuses a pod bringing its own assignment, and impossible requests
    for name, limits, ann in (("greedy", {RES: "1", RES + "cores": "150"}, {}),):
        out = subprocess.run(
            [str(BIN / "kubectl"), "apply", "-f", "-"],
            input=pod(name, limits, ann),
            capture_output=True,
            text=True,
            env=ENV,
        )
        print(f"{name}: rc={out.returncode} {out.stderr.strip()[:300]}")
        assert out.returncode != 0
    # 4) without the webhook (another namespace) a pod with nodeName preset is refused at admission on the node
    kubectl("create", "namespace", NS + "-raw")
    share1 = json.loads(kubectl("-n", NS, "get", "pod", "share-1", "-o", "json"))["metadata"]["annotations"]
    stolen = {k: share1[k] for k in ("kxpu.io/assignment", "kxpu.io/assignment-signature")}
    raw = pod("raw", {RES: "1", RES + "mem": "100"}, stolen, nodeName=NODE).replace(
        f"namespace: {NS}", f"namespace: {NS}-raw"
    )
    kubectl("apply", "-f", "-", input=raw)
    wait(
        "raw refused by the node",
        lambda: kubectl("-n", NS + "-raw", "get", "pod", "raw", "-o", "jsonpath={.status.phase}") == "Failed",
        60,
    )
    print("raw:", kubectl("-n", NS + "-raw", "get", "pod", "raw", "-o", "jsonpath={.status.message}")[:400])
    print(
        "raw events:", kubectl("-n", NS + "-raw", "get", "events", "-o", "jsonpath={.items[*].message}")[:600]
    )
    lock = kubectl(
        "get", "node", NODE, "-o", "jsonpath={.metadata.annotations.kxpu\\.io/lock\\.smoke\\.kxpu\\.io_npu}"
    )
    print("lock left on node:", repr(lock))
    print("SMOKE OK")


def cleanup() -> None:
    subprocess.run(
        [
            str(BIN / "kubectl"),
            "delete",
            "mutatingwebhookconfiguration,validatingwebhookconfiguration",
            "kxpu-smoke",
            "--ignore-not-found",
        ],
        env=ENV,
        capture_output=True,
    )
    for ns in (NS, NS + "-raw"):
        subprocess.run(
            [str(BIN / "kubectl"), "delete", "namespace", ns, "--ignore-not-found", "--wait=false"],
            env=ENV,
            capture_output=True,
        )
    for p in reversed(procs):
        p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
    subprocess.run(
        [
            str(BIN / "kubectl"),
            "annotate",
            "node",
            NODE,
            "kxpu.io/devices.smoke.kxpu.io_npu-",
            "kxpu.io/lock.smoke.kxpu.io_npu-",
        ],
        env=ENV,
        capture_output=True,
    )
    subprocess.run(
        [str(BIN / "kubectl"), "label", "node", NODE, "kxpu.io/sharing-"], env=ENV, capture_output=True
    )


if __name__ == "__main__":
    try:
        main()
    except Exception as exc:
        print("SMOKE FAILED:", exc)
        for name in ("extender", "plugin", "kube-scheduler", "webhook"):
            print(f"--- {name} log tail ---")
            print("\n".join((WORK / f"{name}.log").read_text(errors="replace").splitlines()[-25:]))
        sys.exit(1)
    finally:
        cleanup()
