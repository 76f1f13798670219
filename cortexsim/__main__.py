"""`python -m cortexsim`: the same entry point as `cortex sim`."""

import sys

from cortexsim.cli import main

sys.exit(main())
