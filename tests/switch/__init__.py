"""Tests of hpcdl.switch."""
