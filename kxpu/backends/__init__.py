"""Device backends. Importing this package registers the built-in ones."""

from kxpu.backends import generic, nvidia, simulated
from kxpu.backends.registry import BackendConfig, import_backend_module, lookup, register_backend

__all__ = [
    "BackendConfig",
    "generic",
    "import_backend_module",
    "lookup",
    "nvidia",
    "register_backend",
    "simulated",
]
