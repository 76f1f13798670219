"""`python -m cortex.sim`: the same entry point as `cortex sim`."""

import sys

from cortex.sim.cli import main

sys.exit(main())
