"""A stand-in for the ``amdsmi`` Python package, for the calls the AMD backend makes.

Names, shapes and error codes follow ROCm/amdsmi ``py-interface`` (``amdsmi_interface.py``,
``amdsmi_exception.py``): ``amdsmi_init``/``amdsmi_shut_down``, ``amdsmi_get_processor_handles``
(opaque handles), ``amdsmi_get_gpu_device_bdf`` (``"0000:0c:00.0"``),
``amdsmi_get_gpu_total_ecc_count`` (``{"correctable_count", "uncorrectable_count",
"deferred_count"}``); failures raise ``AmdSmiLibraryException`` carrying ``err_code`` (an
``amdsmi_status_t``). Calls before ``amdsmi_init`` fail with ``AMDSMI_STATUS_NOT_INIT`` as the
library does. The ECC counts come from the fake machine's ``ras/umc_err_count``, so one change
shows both ways.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

AMDSMI_STATUS_SUCCESS = 0
AMDSMI_STATUS_INVAL = 1
AMDSMI_STATUS_NOT_SUPPORTED = 2
AMDSMI_STATUS_FAIL_LOAD_MODULE = 4
AMDSMI_STATUS_INIT_ERROR = 18
AMDSMI_STATUS_NOT_FOUND = 31
AMDSMI_STATUS_NOT_INIT = 32
AMDSMI_STATUS_DRIVER_NOT_LOADED = 34

_NAMES = {
    AMDSMI_STATUS_INVAL: "AMDSMI_STATUS_INVAL",
    AMDSMI_STATUS_NOT_SUPPORTED: "AMDSMI_STATUS_NOT_SUPPORTED",
    AMDSMI_STATUS_FAIL_LOAD_MODULE: "AMDSMI_STATUS_FAIL_LOAD_MODULE",
    AMDSMI_STATUS_INIT_ERROR: "AMDSMI_STATUS_INIT_ERROR",
    AMDSMI_STATUS_NOT_FOUND: "AMDSMI_STATUS_NOT_FOUND",
    AMDSMI_STATUS_NOT_INIT: "AMDSMI_STATUS_NOT_INIT",
    AMDSMI_STATUS_DRIVER_NOT_LOADED: "AMDSMI_STATUS_DRIVER_NOT_LOADED",
}


class AmdSmiException(Exception):
    """Base of amdsmi's exceptions."""


class AmdSmiLibraryException(AmdSmiException):
    def __init__(self, err_code: int) -> None:
        super().__init__(err_code)
        self.err_code = err_code
        self.err_info = _NAMES.get(err_code, f"AMDSMI_STATUS_{err_code}")

    def __str__(self) -> str:
        return f"An error occurred with code: {self.err_code}({self.err_info})"


class AmdSmiInitFlags:
    INIT_ALL_PROCESSORS = 0xFFFFFFFF
    INIT_AMD_GPUS = 1 << 1


class _Handle:
    def __init__(self, bdf: str) -> None:
        self.bdf = bdf

    def __repr__(self) -> str:
        return f"<amdsmi_processor_handle {self.bdf}>"


class FakeAmdSmi:
    """Module-like: pass an instance where the backend takes ``amdsmi``."""

    AmdSmiException = AmdSmiException
    AmdSmiLibraryException = AmdSmiLibraryException
    AmdSmiInitFlags = AmdSmiInitFlags

    def __init__(self, root: Path) -> None:
        self.root = root
        self.initialized = False
        self.init_error: int | None = None  # set to make amdsmi_init fail with this code
        self.call_error: dict[str, int] = {}  # function name → code it fails with
        self.ecc_override: dict[str, int] = {}  # BDF → uncorrectable count, instead of the tree's

    def _check(self, name: str) -> None:
        if not self.initialized:
            raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_INIT)
        if name in self.call_error:
            raise AmdSmiLibraryException(self.call_error[name])

    def amdsmi_init(self, flag: int = AmdSmiInitFlags.INIT_AMD_GPUS) -> None:
        if self.init_error is not None:
            raise AmdSmiLibraryException(self.init_error)
        if not (self.root / "sys/module/amdgpu").is_dir():
            raise AmdSmiLibraryException(AMDSMI_STATUS_DRIVER_NOT_LOADED)
        self.initialized = True

    def amdsmi_shut_down(self) -> None:
        self._check("amdsmi_shut_down")
        self.initialized = False

    def amdsmi_get_processor_handles(self) -> list[Any]:
        self._check("amdsmi_get_processor_handles")
        drivers = self.root / "sys/bus/pci/drivers/amdgpu"
        if not drivers.is_dir():
            raise AmdSmiLibraryException(AMDSMI_STATUS_DRIVER_NOT_LOADED)
        return [_Handle(name) for name in sorted(p.name for p in drivers.iterdir() if ":" in p.name)]

    def amdsmi_get_gpu_device_bdf(self, handle: Any) -> str:
        self._check("amdsmi_get_gpu_device_bdf")
        if not isinstance(handle, _Handle):
            raise AmdSmiLibraryException(AMDSMI_STATUS_INVAL)
        return str(handle.bdf)

    def amdsmi_get_gpu_total_ecc_count(self, handle: Any) -> dict[str, int]:
        self._check("amdsmi_get_gpu_total_ecc_count")
        if not isinstance(handle, _Handle):
            raise AmdSmiLibraryException(AMDSMI_STATUS_INVAL)
        if handle.bdf in self.ecc_override:
            return {
                "correctable_count": 0,
                "uncorrectable_count": self.ecc_override[handle.bdf],
                "deferred_count": 0,
            }
        path = self.root / "sys/bus/pci/drivers/amdgpu" / handle.bdf / "ras/umc_err_count"
        try:
            text = path.read_text()
        except OSError:
            raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_SUPPORTED) from None
        counts = dict(line.split(":", 1) for line in text.split("\n") if ":" in line)
        return {
            "correctable_count": int(counts.get("ce", "0")),
            "uncorrectable_count": int(counts.get("ue", "0")),
            "deferred_count": 0,
        }
