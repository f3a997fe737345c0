"""Tests of hpcdl.switch; ``network`` is the in-memory network with loss, duplication and reordering."""
