"""The libraries kxpu loads before it registers, loaded and used once with none of kxpu's own code.

``bench/bench_startup.py --libs-floor`` runs the bare registrars with ``BARE_WITH_LIBS=1``: they call ``load``
before their first socket, so exec → registered of that contender is the bare floor plus what the libraries
the design keeps cost on their own (the command line through click, the config as YAML validated by a
pydantic model, structlog configured, the generated protobuf modules, an inotify watch). What kxpu takes above
that contender is its own code; what that contender takes above the bare floor no change to kxpu can remove.
"""

from __future__ import annotations

import importlib
import os
from typing import Literal

CONFIG = """
version: v1
devicePluginDir: /var/lib/kubelet/device-plugins
resources:
  - name: example.com/npu
    simulated: {count: 64, model: sim}
"""


def load(dra: bool) -> None:
    """Import and use each kept library once, as a starting daemon does."""
    import asyncinotify
    import click
    import pydantic
    import structlog
    import yaml

    generated = (
        ["kxpu.api.dra.v1.api_pb2_grpc", "kxpu.api.pluginregistration.v1.api_pb2_grpc"]
        if dra
        else ["kxpu.api.deviceplugin.v1beta1.api_pb2_grpc"]
    )
    for module in generated:  # each imports its messages
        importlib.import_module(module)

    class Simulated(pydantic.BaseModel):
        count: int = pydantic.Field(ge=0)
        model: str

    class Resource(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        name: str
        simulated: Simulated | None = None

    class Config(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid", populate_by_name=True)
        version: Literal["v1"]
        device_plugin_dir: str = pydantic.Field(alias="devicePluginDir")
        resources: list[Resource]

    @click.command()
    @click.option("--config", default="config.yaml")
    def command(config: str) -> None:
        del config

    command.main(["--config", "config.yaml"], standalone_mode=False)
    Config.model_validate(yaml.safe_load(CONFIG))
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    structlog.get_logger().debug("loaded")
    with asyncinotify.Inotify() as watch:
        watch.add_watch(os.getcwd(), asyncinotify.Mask.CREATE | asyncinotify.Mask.DELETE)


def wanted() -> bool:
    """Whether this registrar is the libraries' floor (``BARE_WITH_LIBS=1``)."""
    return os.environ.get("BARE_WITH_LIBS") == "1"
