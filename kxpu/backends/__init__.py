"""Device backends. Every built-in backend (``simulated``, ``generic`` and every vendor's) loads on first use of its
key (see registry._LAZY_BUILTINS): a node daemon loads only the backends its config names."""

from kxpu.backends.registry import BackendConfig, import_backend_module, lookup, register_backend

__all__ = [
    "BackendConfig",
    "import_backend_module",
    "lookup",
    "register_backend",
]
