"""``python -m hpcdl.bench``."""

from hpcdl.bench import main
from hpcdl.driver.cli import entry

entry(main, "hpcdl.bench")
