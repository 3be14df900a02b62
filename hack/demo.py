"""`make demo`: the node daemon serving simulated NPUs to a kubelet stand-in, step by step.

Everything runs for real over unix sockets in a temporary directory: the daemon is a
separate `kxpu plugin` process; the stand-in registers it the way the kubelet's device
manager does. Prints registration, the device list, a health flip, an allocation, a
refused request, a kubelet restart, and a clean stop.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import grpc
import yaml

from kxpu.testing import KubeletStandIn
from kxpu.testing.kubelet import sockets_in
from kxpu.testing.process import DaemonProcess

RESOURCE = "example.com/npu"


def step(title: str) -> None:
    print(f"\n\033[1m== {title}\033[0m", flush=True)


def show(devices: dict[str, str]) -> None:
    for device_id, health in devices.items():
        print(f"   {device_id:<12} {health}")


async def demo(base: Path) -> int:
    plugin_dir = base / "device-plugins"
    state = base / "npu-state.json"
    config = base / "kxpu.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "version": "v1",
                "devicePluginDir": str(plugin_dir),
                "resources": [
                    {
                        "name": RESOURCE,
                        "simulated": {
                            "count": 4,
                            "model": "sim-npu",
                            "memoryMiB": 16384,
                            "numaNodes": [0, 0, 1, 1],
                            "stateFile": str(state),
                            "env": {"NPU_VISIBLE_DEVICES": "{ids}"},
                        },
                    }
                ],
            },
            sort_keys=False,
        )
    )
    step(f"config ({config})")
    print(config.read_text())

    kubelet = KubeletStandIn(plugin_dir)
    await kubelet.start()
    daemon = DaemonProcess(config, base / "kxpu.log")
    await daemon.start()
    try:
        step("kxpu plugin registers with the kubelet")
        view = await kubelet.wait_registered(RESOURCE, timeout=20)
        print(f"   {RESOURCE} registered on {view.endpoint}")
        print(
            f"   options: preferred allocation={view.options.get_preferred_allocation_available}, "
            f"pre-start={view.options.pre_start_required}"
        )
        step("ListAndWatch: the device list the kubelet sees")
        show(view.devices)
        print(f"   capacity={view.capacity} allocatable={view.allocatable}")

        step("health flip: sim-npu-2 turns Unhealthy in the state file")
        flipped = time.monotonic()
        state.write_text(json.dumps({"sim-npu-2": "Unhealthy"}))
        devices = await kubelet.wait_devices(RESOURCE, lambda d: d.get("sim-npu-2") == "Unhealthy")
        print(f"   new list after {1000 * (view.history[-1].at - flipped):.1f} ms")
        show(devices)
        print(f"   allocatable={view.allocatable}")

        step("a pod asks for 2 devices: GetPreferredAllocation, then Allocate")
        healthy = [i for i, h in view.devices.items() if h == "Healthy"]
        chosen = await kubelet.preferred(RESOURCE, healthy, [], 2)
        print(f"   preferred (same NUMA node): {chosen}")
        response = await kubelet.allocate(RESOURCE, chosen)
        print(f"   container env: {dict(response.container_responses[0].envs)}")

        step("a request for the unhealthy device is refused")
        try:
            await kubelet.allocate(RESOURCE, ["sim-npu-2"])
        except grpc.aio.AioRpcError as err:
            print(f"   {err.code().name}: {err.details()}")

        step("the kubelet restarts (every socket deleted, kubelet.sock re-created)")
        restarted = time.monotonic()
        await kubelet.restart()
        await kubelet.wait_registered(RESOURCE, times=2, timeout=10)
        print(f"   re-registered after {1000 * (time.monotonic() - restarted):.0f} ms")

        step("SIGTERM: kxpu stops serving and removes its socket")
        daemon.send(signal.SIGTERM)
        code = await daemon.wait(10)
        print(f"   exit code {code}; sockets left: {sockets_in(plugin_dir)}")
        return 0 if code == 0 else 1
    except Exception:
        print("\n--- kxpu log ---\n" + daemon.log_text(), file=sys.stderr)
        raise
    finally:
        await daemon.stop()
        await kubelet.stop()


def main() -> int:
    base = Path(tempfile.mkdtemp(prefix="kxpu-demo-", dir="/tmp"))
    try:
        return asyncio.run(demo(base))
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
