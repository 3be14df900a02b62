"""CDI (Container Device Interface) output for any backend: spec files and qualified device names."""

from kxpu.cdi.backend import CdiBackend, with_cdi
from kxpu.cdi.spec import annotation_key, build_spec, qualified_name, validate_kind, validate_spec, write_spec

__all__ = [
    "CdiBackend",
    "annotation_key",
    "build_spec",
    "qualified_name",
    "validate_kind",
    "validate_spec",
    "with_cdi",
    "write_spec",
]
