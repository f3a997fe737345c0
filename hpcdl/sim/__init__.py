"""The hybrid simulator: N virtual ranks in one process, real compute, virtual time."""
