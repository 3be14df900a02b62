"""``python -m e2e.cluster``."""

import sys

from e2e.cluster.cli import main

sys.exit(main())
