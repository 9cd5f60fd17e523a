"""`python -m edgemtp.cli`: the `edgemtp` command without the installed script."""

import sys

from edgemtp.cli import main

sys.exit(main())
