"""`python -m async_rlhf.plan ...`: see `config/cli.py`."""

import sys

from async_rlhf.plan.cli import main

sys.exit(main(sys.argv[1:]))
