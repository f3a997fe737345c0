# shellcheck shell=bash disable=SC2034  # settings read by the job scripts
# Site settings sourced by the job scripts in jobs/ (Slurm and PBS). Edit for your machine.
# Every HPCDL_* setting can also be given at submission without editing this file:
#   sbatch --export=ALL,HPCDL_REQUEUE=0 jobs/slurm/train.sbatch ...
#   qsub -v HPCDL_MARGIN=300 jobs/pbs/train.pbs
# Slurm: https://slurm.schedmd.com/sbatch.html   PBS Pro: https://2021.help.altair.com/2021.1.2/PBS%20Professional/PBSUserGuide2021.1.2.pdf

# Modules providing Python and the site's MPI (mpi4py must be built against it: see
# docs/clusters.md, "Installing on a cluster"). Load them here so every job sees the same ones.
# module load python openmpi

# The virtual environment holding hpcdl (on a file system the compute nodes can read).
HPCDL_VENV="${HPCDL_VENV:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.venv}"

# PBS: the site's MPI launcher, with any site flags (word-split; no quoting inside).
# jobs/pbs/train.pbs appends `-n <ranks> --hostfile $PBS_NODEFILE`, which Open MPI's
# mpirun, MPICH/Intel MPI's hydra mpiexec and Cray PALS mpiexec all accept. The launcher
# must forward SIGUSR1 to the ranks (hydra and Open MPI's mpirun do). Examples:
#   HPCDL_MPIEXEC="mpiexec --ppn 4 --depth 8 --cpu-bind depth"   (Cray PALS, e.g. ALCF Polaris)
# Slurm uses srun, which forwards the signals it receives to the tasks:
#   https://slurm.schedmd.com/srun.html#SECTION_SIGNALS-AND-ESCAPE-SEQUENCES
HPCDL_MPIEXEC="${HPCDL_MPIEXEC:-mpiexec}"

# Slurm: the process-management interface srun offers the ranks (srun --mpi=TYPE). It must
# be one that the MPI library under mpi4py speaks: without it, srun -n N starts N separate
# one-rank MPI worlds (hpcdl.train refuses to start them). Slurm's own default,
# MpiDefault=none, offers none. The type each MPI needs:
#   pmi2   MPICH, including PyPI's mpich wheel that `make install` puts in the venv; Intel MPI
#   pmix   Open MPI built with PMIx (the usual build on Slurm clusters)
# Empty: use the cluster's MpiDefault. `srun --mpi=list` shows what the cluster offers.
#   https://slurm.schedmd.com/mpi_guide.html
HPCDL_SRUN_MPI="${HPCDL_SRUN_MPI-pmi2}"

# Cores per rank: BLAS and OpenMP threads must not oversubscribe a node. Taken from
# Slurm's --cpus-per-task (SLURM_CPUS_PER_TASK), or from PBS's ncpus per chunk (NCPUS)
# divided by the ranks (mpiprocs) on this node, else 1; HPCDL_THREADS overrides.
# (PBS Pro itself sets OMP_NUM_THREADS=ncpus, which oversubscribes with mpiprocs > 1,
# so the variables are set here unconditionally.)
if [[ -n "${HPCDL_THREADS:-}" ]]; then
    :
elif [[ -n "${SLURM_CPUS_PER_TASK:-}" ]]; then
    HPCDL_THREADS=$SLURM_CPUS_PER_TASK
elif [[ -n "${NCPUS:-}" && -r "${PBS_NODEFILE:-}" ]]; then
    _ranks_here=$(grep -cxF "$(head -n 1 "$PBS_NODEFILE")" "$PBS_NODEFILE" || true)
    HPCDL_THREADS=$(( NCPUS / (_ranks_here > 0 ? _ranks_here : 1) ))
    (( HPCDL_THREADS >= 1 )) || HPCDL_THREADS=1
    unset _ranks_here
else
    HPCDL_THREADS=1
fi
export OPENBLAS_NUM_THREADS=$HPCDL_THREADS OMP_NUM_THREADS=$HPCDL_THREADS MKL_NUM_THREADS=$HPCDL_THREADS

# Warning margin: seconds before the walltime at which training is asked (SIGUSR1) to
# write a checkpoint and stop. It must cover finishing the current step, writing the
# checkpoint, and (Slurm) the scheduler's up-to-60-s lateness/earliness.
# - PBS has no portable pre-walltime signal: train.pbs starts a timer that fires at
#   walltime - HPCDL_MARGIN. Change it here or with `qsub -v HPCDL_MARGIN=300`.
# - Slurm sends the signal itself, as set by `#SBATCH --signal=B:USR1@120` in
#   train.sbatch (directives cannot read variables): change that line, or override it
#   per job with `sbatch --signal=B:USR1@300 ...`.
#   https://slurm.schedmd.com/sbatch.html#OPT_signal
HPCDL_MARGIN="${HPCDL_MARGIN:-120}"

# Slurm: after a stop caused by the warning signal, requeue the job (same job id, same
# job name, hence the same run file) so that it continues in a new allocation. Needs
# `#SBATCH --requeue` (set in train.sbatch) and a cluster that allows requeueing.
#   https://slurm.schedmd.com/scontrol.html#OPT_requeue
#   https://slurm.schedmd.com/sbatch.html#OPT_requeue
HPCDL_REQUEUE="${HPCDL_REQUEUE:-1}"

# PBS: after a stop caused by the timer, submit the same script again with the same
# arguments, job name and resources (qsub must be usable from the compute nodes).
#   PBS Professional Reference Guide, "qsub" (-v variable lists)
HPCDL_RESUBMIT="${HPCDL_RESUBMIT:-1}"

# Both: give up after this many requeues/resubmissions (a run that cannot make progress
# in one allocation must not loop forever). Slurm counts with SLURM_RESTART_COUNT, PBS
# with HPCDL_RESTARTS (passed on by train.pbs).
HPCDL_MAX_RESTARTS="${HPCDL_MAX_RESTARTS:-50}"
