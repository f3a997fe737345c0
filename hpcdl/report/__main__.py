"""``python -m hpcdl.report``."""

from hpcdl.driver.cli import entry
from hpcdl.report import main

entry(main, "hpcdl.report")
