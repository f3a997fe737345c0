# Site settings sourced by the job scripts in jobs/. Edit for your machine.
# Slurm: https://slurm.schedmd.com/sbatch.html   PBS Pro: https://2021.help.altair.com/2021.1.2/PBS%20Professional/PBSUserGuide2021.1.2.pdf

# Modules providing Python and the site's MPI (mpi4py must be built against it: see README).
# module load python openmpi
HPCDL_VENV="${HPCDL_VENV:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.venv}"

# Cores per rank: BLAS and OpenMP threads must not oversubscribe a node.
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
