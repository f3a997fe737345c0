"""Tests of hpcdl.comm; ``conformance`` holds the bodies shared with the simulator's tests."""
