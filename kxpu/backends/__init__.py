"""Device backends. Importing this package registers the light built-in ones; `nvidia` loads on
first use of its key (see registry._LAZY_BUILTINS)."""

from kxpu.backends import generic, simulated
from kxpu.backends.registry import BackendConfig, import_backend_module, lookup, register_backend

__all__ = [
    "BackendConfig",
    "generic",
    "import_backend_module",
    "lookup",
    "register_backend",
    "simulated",
]
