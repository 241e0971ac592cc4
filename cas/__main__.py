"""`python -m cas`: the `cas` command line."""

import sys

from .cli import main

sys.exit(main())
