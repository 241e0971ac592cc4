"""`python -m cas.cli`, as the tests and older scripts run it (`python -m cas` is the same)."""

import sys

from . import main

sys.exit(main())
