"""`python -m benchlib ...`: the `benchlib` command, for an environment whose scripts are not on the PATH."""

import sys

from benchlib.runner.cli import main

sys.exit(main())
