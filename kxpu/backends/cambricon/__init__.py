"""Cambricon MLUs: libcndev through ctypes (a module-like object, loaded when the backend starts)."""

from kxpu.backends.cambricon.backend import CambriconBackend, CambriconConfig

__all__ = ["CambriconBackend", "CambriconConfig"]
