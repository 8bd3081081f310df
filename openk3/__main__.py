"""`python -m openk3`: the same commands as the `openk3` executable (openk3/cli.py)."""

import sys

from openk3.cli import main

sys.exit(main())
