"""How the ranks were launched: refuse unconnected ranks, tell the job script when they can take a stop.

Two checks at the start of a command, both for batch jobs (``jobs/``):

* **Unconnected ranks.** A launcher that starts N processes without the process
  manager interface (PMI) their MPI library speaks — ``srun`` under Slurm's default
  ``MpiDefault=none`` for PyPI's MPICH, or another MPI's ``mpiexec`` — leaves N
  singleton MPI worlds of one rank each: every process would train alone and write the
  same run file. The launcher's variables say how many processes it started; if they
  say several and MPI says one rank, :func:`check_world_size` refuses.
* **Ready for a stop.** A SIGUSR1 that reaches a rank before the entry point has
  installed its stop-signal handlers kills it (no checkpoint, no requeue). The job
  scripts hold the walltime warning until rank 0 has created the file named by
  ``HPCDL_READY_FILE``, which :func:`signal_ready` does once every rank has its
  handlers (``hpcdl.driver.cli.entry(..., stop_signals=True)`` installs them before ``main``
  runs; a barrier after that proves every rank is past it).

Neither applies in the simulator, whose virtual ranks share one process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from hpcdl.comm import Communicator
from hpcdl.errors import ConfigError, file_error

__all__ = ["LAUNCHER_VARS", "READY_FILE_VAR", "check_world_size", "launched_tasks", "signal_ready", "started"]

#: the variable naming the file rank 0 creates once every rank can take a stop signal
READY_FILE_VAR = "HPCDL_READY_FILE"

#: variables in which a launcher tells each process how many processes it started (the
#: first one set is read), and who sets them. Only per-process launch variables: a
#: batch script's own SLURM_NTASKS (the job's task count) is set without any launch, so a
#: plain one-process run inside an allocation is never refused.
LAUNCHER_VARS: tuple[tuple[str, str], ...] = (
    ("SLURM_STEP_NUM_TASKS", "srun"),  # every task of a Slurm job step
    ("OMPI_COMM_WORLD_SIZE", "Open MPI's mpirun"),
    ("PMI_SIZE", "the launcher"),  # MPICH/Intel MPI hydra mpiexec, Cray PALS, srun --mpi=pmi2
    ("MV2_COMM_WORLD_SIZE", "MVAPICH's mpirun_rsh"),
)


def launched_tasks(env: Mapping[str, str] | None = None) -> tuple[int, str, str] | None:
    """How many processes the launcher says it started, as ``(count, variable, launcher)``.

    Args:
        env: the environment to read (default ``os.environ``).

    Returns:
        The first of :data:`LAUNCHER_VARS` that is set to a whole number, or None when
        no launcher announced itself (a plain ``python -m ...``).
    """
    env = os.environ if env is None else env
    for var, launcher in LAUNCHER_VARS:
        value = env.get(var, "").strip()
        if value.isdigit():
            return int(value), var, launcher
    return None


def check_world_size(size: int, env: Mapping[str, str] | None = None) -> None:
    """Refuse a world of one rank when the launcher started several processes.

    Args:
        size: the number of ranks MPI sees (``comm.Get_size()``).
        env: the environment to read (default ``os.environ``).

    Raises:
        ConfigError: ``size`` is 1 while the launcher's variables say it started more
            processes (each of them is then a separate MPI world of one rank).
    """
    found = launched_tasks(env)
    if size != 1 or found is None or found[0] <= 1:
        return
    count, var, launcher = found
    if var == "SLURM_STEP_NUM_TASKS":
        fix = (
            "give srun the PMI of your MPI: --mpi=pmi2 for MPICH (HPCDL_SRUN_MPI in jobs/site.sh; "
            "`srun --mpi=list` shows what the cluster offers)"
        )
    else:
        fix = (
            "launch with the mpiexec of the MPI that mpi4py uses "
            "(python -c 'from mpi4py import MPI; print(MPI.Get_library_version())')"
        )
    raise ConfigError(
        f"{launcher} started {count} processes ({var}={count}) but MPI sees 1 rank in each: "
        f"the launcher did not connect them, so each would train alone; {fix}"
    )


def signal_ready(comm: Communicator, env: Mapping[str, str] | None = None) -> Path | None:
    """Create the file named by ``HPCDL_READY_FILE`` once every rank can take a stop signal.

    A collective when the variable is set (a barrier, then rank 0 creates the file);
    nothing at all when it is not. Call it after the stop-signal handlers are
    installed, i.e. from ``main``.

    Args:
        comm: the world communicator.
        env: the environment to read (default ``os.environ``).

    Returns:
        The file rank 0 created, or None (another rank, or the variable is not set).

    Raises:
        FileError: rank 0 cannot create the file.
    """
    env = os.environ if env is None else env
    name = env.get(READY_FILE_VAR, "")
    if not name:
        return None
    if comm.Get_size() > 1:
        comm.Barrier()  # every rank is past the entry point's handler installation
    if comm.Get_rank() != 0:
        return None
    path = Path(name)
    try:
        path.touch()
    except OSError as err:
        raise file_error(path, err, what=f"the ready file ({READY_FILE_VAR})", verb="create") from None
    return path


def started(comm: Communicator, env: Mapping[str, str] | None = None) -> None:
    """At the start of a command: :func:`check_world_size`, then :func:`signal_ready`.

    Nothing happens in the simulator (a world with ``sim_attrs``): its virtual ranks
    share one process, whatever launched it.

    Args:
        comm: the world communicator.
        env: the environment to read (default ``os.environ``).

    Raises:
        ConfigError: the launcher's ranks are not connected (see :func:`check_world_size`).
        FileError: the ready file cannot be created.
    """
    if getattr(comm, "sim_attrs", None) is not None:
        return
    check_world_size(comm.Get_size(), env)
    signal_ready(comm, env)
