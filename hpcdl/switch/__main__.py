"""``python -m hpcdl.switch``: the aggregation switch program (see :mod:`hpcdl.switch.program`)."""

import sys

from hpcdl.switch.program import main

raise SystemExit(main(sys.argv[1:]))
