import sys

from e2e.cluster.core import main

sys.exit(main())
