"""Device backends. Importing this package registers the simulated backend; the others (`generic` and
every vendor's) load on first use of their key (see registry._LAZY_BUILTINS)."""

from kxpu.backends import simulated
from kxpu.backends.registry import BackendConfig, import_backend_module, lookup, register_backend

__all__ = [
    "BackendConfig",
    "import_backend_module",
    "lookup",
    "register_backend",
    "simulated",
]
