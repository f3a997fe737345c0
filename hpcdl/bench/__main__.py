"""``python -m hpcdl.bench``."""

from hpcdl.bench import main
from hpcdl.cli import entry

entry(main, "hpcdl.bench")
