"""`python -m slidedp ...`: the `slidedp` command, also where the package is only on the path."""

import sys

from slidedp.cli import main

sys.exit(main())
