"""HAMi / extender pod specs converted at admission into DRA consumable-capacity claims (``convertToClaims``):
the conversion per vendor's names, what a claim cannot express (one-line denials), and the webhook's answers
(templates made before the answer, none in a dry run, a denial when they cannot be made)."""

from __future__ import annotations

import copy
import ssl
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import trustme
from aiohttp import web

from kxpu.kube.sharing.templates import TemplateError, same_template
from kxpu.sharing import webhook
from kxpu.sharing.claims import MAX_TEMPLATES_PER_POD, ClaimFamily, Template, convert
from kxpu.sharing.control_plane import ControlPlaneConfig, FamilyConfig
from kxpu.sharing.requests import RequestError
from kxpu.testing.sharing import pod
from tests.test_sharing_webhook import Server, request

# Each vendor kxpu shares, with the names the control plane's families give them (docs/vendor-*.md).
NVIDIA = FamilyConfig(resource="nvidia.com/gpu")
HYGON = FamilyConfig(resource="hygon.com/dcunum", memory="hygon.com/dcumem", cores="hygon.com/dcucores")
ASCEND = FamilyConfig(
    resource="huawei.com/Ascend910B3",
    memory="huawei.com/Ascend910B3-memory",
    cores="huawei.com/Ascend910B3-core",
)
CAMBRICON = FamilyConfig(
    resource="cambricon.com/vmlu",
    memory="cambricon.com/mlu.smlu.vmemory",
    cores="cambricon.com/mlu.smlu.vcore",
)
FAMILIES = [f.claim_family() for f in (NVIDIA, HYGON, ASCEND, CAMBRICON)]


def apply_patch(obj: dict[str, Any], ops: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902 add (``-`` appends) and remove, as the API server applies them."""
    obj = copy.deepcopy(obj)
    for op in ops:
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        target: Any = obj
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        if op["op"] == "remove":
            del target[last]
        elif op["op"] == "replace":
            assert last in target
            target[last] = op["value"]
        elif isinstance(target, list):
            target.append(op["value"]) if last == "-" else target.insert(int(last), op["value"])
        else:
            assert op["op"] == "add"
            target[last] = op["value"]
    return obj


def converted(p: dict[str, Any]) -> tuple[dict[str, Any], list[Template]]:
    done = convert(p, p["metadata"]["namespace"], FAMILIES, ["CUDA_DEVICE_MEMORY_LIMIT*"])
    return apply_patch(p, done.patch), done.templates


def request_of(template: Template) -> dict[str, Any]:
    (only,) = template.spec["devices"]["requests"]
    body: dict[str, Any] = only["exactly"]
    return body


@pytest.mark.parametrize(
    ("family", "limits", "device_class", "capacity"),
    [
        (NVIDIA, {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 3000}, "gpu.nvidia.com", {"memory": "3000Mi", "cores": "0"}),
        (
            NVIDIA,
            {"nvidia.com/gpu": 2, "nvidia.com/gpumem": "4Ki", "nvidia.com/gpucores": 30},
            "gpu.nvidia.com",
            {"memory": "4Gi", "cores": "30"},  # as the API server stores it
        ),
        # 100 % of the memory is the published default: no memory request, the whole memory is consumed
        (NVIDIA, {"nvidia.com/gpumem-percentage": 100, "nvidia.com/gpucores": 50}, "gpu.nvidia.com", {"cores": "50"}),
        # only a count: the whole device, exclusive (the extender's gpucores=100)
        (NVIDIA, {"nvidia.com/gpu": 1}, "gpu.nvidia.com", None),
        (HYGON, {"hygon.com/dcunum": 1, "hygon.com/dcumem": 2048, "hygon.com/dcucores": 25}, "dcunum.hygon.com",
         {"memory": "2Gi", "cores": "25"}),
        (ASCEND, {"huawei.com/Ascend910B3": 1, "huawei.com/Ascend910B3-memory": 16384,
                  "huawei.com/Ascend910B3-core": 25}, "ascend910b3.huawei.com", {"memory": "16Gi", "cores": "25"}),
        (CAMBRICON, {"cambricon.com/mlu.smlu.vmemory": 8192, "cambricon.com/mlu.smlu.vcore": 40}, "vmlu.cambricon.com",
         {"memory": "8Gi", "cores": "40"}),
    ],
)  # fmt: skip
def test_each_vendors_names_become_a_capacity_claim(
    family: FamilyConfig, limits: dict[str, Any], device_class: str, capacity: dict[str, str] | None
) -> None:
    p = pod("p", [{**limits, "cpu": "1"}])
    after, (template,) = converted(p)
    container = after["spec"]["containers"][0]
    # the shared-device names are gone (the kubelet never sees them), the rest of the limits stay
    assert container["resources"]["limits"] == {"cpu": "1"}
    (claim,) = after["spec"]["resourceClaims"]
    assert claim["resourceClaimTemplateName"] == template.name
    assert container["resources"]["claims"] == [{"name": claim["name"]}]
    body = request_of(template)
    assert body["deviceClassName"] == device_class
    count = int(limits.get(family.resource, 1))
    assert body["allocationMode"] == "ExactCount" and body["count"] == count
    assert body.get("capacity") == ({"requests": capacity} if capacity else None)
    manifest = template.manifest()
    assert manifest["kind"] == "ResourceClaimTemplate" and manifest["metadata"]["namespace"] == "default"
    assert manifest["spec"]["spec"] == template.spec
    assert after["spec"].get("schedulerName") is None, "the stock scheduler places it"


def test_pods_of_one_shape_share_one_template_and_other_pods_are_untouched() -> None:
    a = converted(pod("a", [{"nvidia.com/gpumem": 3000}]))[1]
    b = converted(pod("b", [{"nvidia.com/gpu": 1, "nvidia.com/gpumem": "3000"}]))[1]
    c = converted(pod("c", [{"nvidia.com/gpumem": 3001}]))[1]
    assert a[0].name == b[0].name != c[0].name
    assert a[0].name.startswith("kxpu-gpu-")
    assert convert(pod("d", [{"cpu": 1}]), "default", FAMILIES).patch == []


def test_a_pod_written_for_the_extender_goes_to_the_stock_scheduler() -> None:
    p = pod("p", [{"nvidia.com/gpumem": 3000}], schedulerName="kxpu-scheduler")
    done = convert(p, "default", FAMILIES, (), "kxpu-scheduler")
    assert apply_patch(p, done.patch)["spec"]["schedulerName"] == "default-scheduler"
    other = pod("p", [{"nvidia.com/gpumem": 3000}], schedulerName="my-scheduler")
    assert (
        apply_patch(other, convert(other, "default", FAMILIES, (), "kxpu-scheduler").patch)["spec"][
            "schedulerName"
        ]
        == "my-scheduler"
    )


def test_requests_equal_to_limits_go_too_and_existing_claims_are_kept() -> None:
    p = pod("p", [{"nvidia.com/gpumem": 3000}, {"hygon.com/dcumem": 1024}])
    p["spec"]["containers"][0]["resources"]["requests"] = {"nvidia.com/gpumem": "3000", "cpu": "1"}
    p["spec"]["containers"][1]["resources"]["claims"] = [{"name": "mine"}]
    p["spec"]["resourceClaims"] = [{"name": "mine", "resourceClaimName": "existing"}]
    after, templates = converted(p)
    assert after["spec"]["containers"][0]["resources"]["requests"] == {"cpu": "1"}
    assert [c["name"] for c in after["spec"]["resourceClaims"]] == ["mine", "kxpu-gpu-0", "kxpu-dcunum-1"]
    assert after["spec"]["containers"][1]["resources"]["claims"] == [
        {"name": "mine"},
        {"name": "kxpu-dcunum-1"},
    ]
    assert len(templates) == 2


def test_device_filters_and_numa_bind_become_selectors_and_a_constraint() -> None:
    annotations = {
        "nvidia.com/use-gputype": "A100,H100",
        "kxpu.io/nouse-uuid": 'GPU-1,evil"||true',
        "nvidia.com/numa-bind": "true",
    }
    _, (template,) = converted(
        pod("p", [{"nvidia.com/gpu": 2, "nvidia.com/gpumem": 1000}], annotations=annotations)
    )
    expressions = [s["cel"]["expression"] for s in request_of(template)["selectors"]]
    attrs = 'device.attributes["gpu.nvidia.com"]'
    assert expressions[0] == (
        f'(has({attrs}.model) && ({attrs}.model.lowerAscii().contains("a100") || '
        f'{attrs}.model.lowerAscii().contains("h100")))'
    )
    # a value is a CEL string literal, quotes escaped: it can never become code
    assert expressions[1].startswith("!((has(") and '"evil\\"||true"' in expressions[1]
    assert template.spec["devices"]["constraints"] == [
        {"requests": ["gpu"], "matchAttribute": "resource.kubernetes.io/numaNode"}
    ]


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        ({"nvidia.com/gpumem-percentage": 50},
         "container 'c0': nvidia.com/gpumem-percentage 50 cannot become a DRA claim (capacity requests are "
         "absolute, in MiB): ask for nvidia.com/gpumem instead"),
        ({"nvidia.com/gpumem-percentage": 101}, "nvidia.com/gpumem-percentage must be 1-100, not 101"),
        ({"nvidia.com/gpucores": 150}, "nvidia.com/gpucores must be 0-100 (percent of a device), not 150"),
        ({"nvidia.com/gpumem": 0}, "nvidia.com/gpumem must be at least 1 (MiB)"),
        ({"nvidia.com/gpumem": "lots"}, "limits nvidia.com/gpumem: 'lots' is not a quantity"),
        ({"nvidia.com/gpumem": 10, "nvidia.com/gpumem-percentage": 10}, "not both"),
        ({"hygon.com/dcunum": 0, "hygon.com/dcumem": 10}, "hygon.com/dcunum must be at least 1"),
        ({"huawei.com/Ascend910B3-memory": "1.5"}, "must be a whole number"),
    ],
)  # fmt: skip
def test_what_no_claim_can_express_is_one_line_naming_it(limits: dict[str, Any], message: str) -> None:
    with pytest.raises(RequestError) as caught:
        convert(pod("p", [limits]), "default", FAMILIES)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_pods_whose_limits_could_not_hold_are_denied() -> None:
    privileged = pod("p", [{"nvidia.com/gpumem": 10}])
    privileged["spec"]["containers"][0]["securityContext"] = {"privileged": True}
    env = pod("p", [{"nvidia.com/gpumem": 10}])
    env["spec"]["containers"][0]["env"] = [{"name": "CUDA_DEVICE_MEMORY_LIMIT_0", "value": "80g"}]
    init = pod("p", [{"cpu": 1}])
    init["spec"]["initContainers"] = [{"name": "i", "resources": {"limits": {"nvidia.com/gpumem": "1"}}}]
    clash = pod("p", [{"nvidia.com/gpumem": 10}])
    clash["spec"]["resourceClaims"] = [{"name": "kxpu-gpu-0", "resourceClaimName": "x"}]
    for bad, message in (
        (privileged, "is privileged"),
        (env, "sets CUDA_DEVICE_MEMORY_LIMIT_0, which kxpu's DRA driver sets"),
        (init, "shared devices are for app containers only"),
        (pod("p", [{"nvidia.com/gpumem": 10}], node="n1"), "not have nodeName preset"),
        (clash, "already has a resourceClaims entry named 'kxpu-gpu-0'"),
    ):
        with pytest.raises(RequestError, match=message):
            convert(bad, "default", FAMILIES, ["CUDA_DEVICE_MEMORY_LIMIT*"])


def test_a_container_that_could_name_the_claim_may_not_set_the_drivers_env() -> None:
    """Any container of the pod, init containers too, may list the pod's claim (its name is predictable) in
    resources.claims and so get the shared device without asking for it in limits: setting the env the driver
    sets from the claim would lift its limits there. The webhook's own check denies the same pods."""
    protected = ["CUDA_DEVICE_MEMORY_LIMIT*"]
    env = [{"name": "CUDA_DEVICE_MEMORY_LIMIT_0", "value": "80g"}]
    init = pod("p", [{"nvidia.com/gpumem": 10}])
    init["spec"]["initContainers"] = [
        {"name": "i", "env": env, "resources": {"claims": [{"name": "kxpu-gpu-0"}]}}
    ]
    sidecar = pod("p", [{"nvidia.com/gpumem": 10}, {"cpu": 1}])
    sidecar["spec"]["containers"][1]["env"] = env
    for bad, who in ((init, "'i'"), (sidecar, repr(sidecar["spec"]["containers"][1]["name"]))):
        with pytest.raises(
            RequestError, match=f"container {who} sets CUDA_DEVICE_MEMORY_LIMIT_0, which kxpu's DRA"
        ):
            convert(bad, "default", FAMILIES, protected)
        denied = webhook.validate(request(bad), [f.family for f in FAMILIES], [], protected_env=protected)
        assert denied is not None and f"container {who} sets CUDA_DEVICE_MEMORY_LIMIT_0" in denied
    plain = pod("p", [{"nvidia.com/gpumem": 10}])
    plain["spec"]["initContainers"] = [{"name": "i", "env": [{"name": "OTHER", "value": "1"}]}]
    assert convert(plain, "default", FAMILIES, protected).templates  # other env is fine


def test_the_config_names_the_class_and_driver_and_refuses_bad_ones() -> None:
    config = ControlPlaneConfig.model_validate(
        {
            "convertToClaims": True,
            "families": [{"resource": "example.com/npu", "deviceClassName": "shared.npu.example.com"}],
        }
    )
    assert config.claim_families() == [
        ClaimFamily(config.families[0].family(), "shared.npu.example.com", "npu.example.com")
    ]
    assert ControlPlaneConfig().convert_to_claims is False
    with pytest.raises(ValueError, match="deviceClassName 'Bad_Class' must be a lowercase DNS subdomain"):
        FamilyConfig(resource="example.com/npu", deviceClassName="Bad_Class")  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="must be a lowercase DNS subdomain"):
        FamilyConfig(resource="example.com/npu", driverName="NPU")  # type: ignore[call-arg]


class Maker:
    """Stands in for ``TemplateStore.ensure`` (same signature): records, or fails as the API server would."""

    def __init__(self) -> None:
        self.made: list[Template] = []
        self.fail: str | None = None

    async def __call__(self, templates: Sequence[Template]) -> None:
        if self.fail:
            raise TemplateError(self.fail)
        self.made += templates


@pytest.fixture
async def dra_server(tmp_path: Path) -> AsyncIterator[tuple[Server, Maker]]:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.private_key_pem.write_to_path(str(tmp_path / "tls.key"))
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "tls.crt"))
    tls = webhook.ReloadingTLS(tmp_path / "tls.crt", tmp_path / "tls.key")
    maker = Maker()
    families = [f.family for f in FAMILIES]
    app = webhook.make_app(families, "kxpu-scheduler", [], claims=FAMILIES, templates=maker)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls.context)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    yield Server(f"https://127.0.0.1:{port}", client_ctx, ca, tmp_path), maker
    await runner.cleanup()


async def test_the_webhook_makes_the_templates_before_it_answers(dra_server: tuple[Server, Maker]) -> None:
    server, maker = dra_server
    answer = await server.review("/mutate", request(pod("p", [{"nvidia.com/gpumem": 3000}])))
    assert answer["allowed"] is True and answer["patchType"] == "JSONPatch"
    (made,) = maker.made
    assert request_of(made)["capacity"] == {"requests": {"memory": "3000Mi", "cores": "0"}}
    # a dry run changes nothing (the configuration says sideEffects: NoneOnDryRun)
    dry = {**request(pod("q", [{"nvidia.com/gpumem": 5}])), "dryRun": True}
    assert (await server.review("/mutate", dry))["allowed"] is True
    assert len(maker.made) == 1


async def test_the_webhook_denies_in_one_line_what_cannot_be_converted_or_made(
    dra_server: tuple[Server, Maker],
) -> None:
    server, maker = dra_server
    bad = await server.review("/mutate", request(pod("p", [{"nvidia.com/gpucores": 101}])))
    assert bad["allowed"] is False
    assert (
        bad["status"]["message"]
        == "container 'c0': nvidia.com/gpucores must be 0-100 (percent of a device), not 101"
    )
    maker.fail = "cannot create ResourceClaimTemplate default/kxpu-gpu-x: forbidden"
    refused = await server.review("/mutate", request(pod("p", [{"nvidia.com/gpumem": 1}])))
    assert refused["allowed"] is False and "patch" not in refused
    assert refused["status"]["message"].startswith("cannot create ResourceClaimTemplate default/kxpu-gpu-x")
    # a pod the mutating webhook never converted is refused: nothing on the DRA path serves those names
    missed = await server.review("/validate", request(pod("p", [{"nvidia.com/gpumem": 1}])))
    assert missed["allowed"] is False and "did not convert this one" in missed["status"]["message"]
    assert (await server.review("/validate", request(pod("p", [{"cpu": 1}]))))["allowed"] is True


async def test_kxpus_annotations_and_label_stay_guarded_while_pods_convert(
    dra_server: tuple[Server, Maker],
) -> None:
    """Pods the extender placed keep running (and counting by their label and signed assignment) while a cluster
    moves to DRA: the webhook in convertToClaims keeps refusing changes to them by anyone else."""
    server, _ = dra_server
    old = pod("p", [{"nvidia.com/gpumem": 1}])
    old["metadata"]["labels"] = {"kxpu.io/assigned": "true"}
    new = copy.deepcopy(old)
    new["metadata"]["labels"] = {}
    answer = await server.review("/validate", request(new, "UPDATE", old))
    assert answer["allowed"] is False and "kxpu.io/assigned" in answer["status"]["message"]
    forged = pod("f", [{"cpu": 1}], annotations={"kxpu.io/assignment": "{}"})
    assert (await server.review("/validate", request(forged)))["allowed"] is False


async def test_a_pod_needing_too_many_templates_is_denied_before_any_is_made(
    dra_server: tuple[Server, Maker],
) -> None:
    """Each template is an API call before the answer and an object left behind: a pod cannot make 17."""
    server, maker = dra_server
    containers = [{"nvidia.com/gpumem": 1000 + n} for n in range(MAX_TEMPLATES_PER_POD + 1)]
    denied = await server.review("/mutate", request(pod("many", containers)))
    assert denied["allowed"] is False and maker.made == []
    assert denied["status"]["message"] == (
        "pod needs 17 distinct claim templates (one per container and shape); kxpu makes at most 16 for one pod: "
        "give its containers fewer distinct shared-device requests"
    )
    # the same shape in every container is one template
    same = await server.review("/mutate", request(pod("same", [{"nvidia.com/gpumem": 1000}] * 20)))
    assert same["allowed"] is True and len(maker.made) == 1


def test_a_template_found_under_kxpus_name_must_be_exactly_kxpus() -> None:
    """Template names are predictable (kxpu-<family>-<hash of the spec>): one made beforehand by someone who may
    write templates in the namespace, with the same requests plus opaque config (env into every container),
    tolerations or labels, must not be taken for kxpu's."""
    (made,) = convert(pod("p", [{"nvidia.com/gpumem": 3000}]), "default", FAMILIES).templates
    theirs = copy.deepcopy(made.spec)
    assert same_template({"spec": theirs}, made.spec)
    with_config = copy.deepcopy(made.spec)
    with_config["devices"]["config"] = [
        {"opaque": {"driver": "gpu.nvidia.com", "parameters": {"env": {"A": "b"}}}}
    ]
    tolerating = copy.deepcopy(made.spec)
    tolerating["devices"]["requests"][0]["exactly"]["tolerations"] = [{"operator": "Exists"}]
    assert not same_template({"spec": with_config}, made.spec)
    assert not same_template({"spec": tolerating}, made.spec)
    assert not same_template({"metadata": {"labels": {"x": "y"}}, "spec": theirs}, made.spec)
    assert not same_template({"spec": {**theirs, "devices": {"requests": []}}}, made.spec)
