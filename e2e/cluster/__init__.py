"""The e2e cluster harness (being split by idea; see core.py for now)."""

from e2e.cluster.core import *  # noqa: F403
from e2e.cluster.core import __doc__ as __doc__
