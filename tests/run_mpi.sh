#!/usr/bin/env bash
# Run the MPI-marked tests under `mpiexec -n N`, one pytest log per rank.
#
#   tests/run_mpi.sh N [pytest args...]      e.g. tests/run_mpi.sh 3 tests/comm -x
#
# Prints rank 0's log, and another rank's log only if that rank failed (or hung).
# Exit status: 0 when every rank passed (pytest's 5, "no tests collected", counts as
# passed: the same on every rank), else non-zero. A hang is killed after
# HPCDL_TEST_TIMEOUT seconds (default 900). Non-MPI tests are deselected (-m mpi).
set -euo pipefail

if [[ $# -lt 1 || ! $1 =~ ^[0-9]+$ ]]; then
    echo "usage: $0 N [pytest args...]" >&2
    exit 2
fi
nprocs=$1
shift

export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
timeout_s=${HPCDL_TEST_TIMEOUT:-900}
python=${PYTHON:-python}
logdir=$(mktemp -d "${TMPDIR:-/tmp}/hpcdl-mpi-tests.XXXXXX")
trap 'rm -rf "$logdir"' EXIT

# Each rank learns its number from PMI_RANK (set by MPICH's hydra; Open MPI sets
# OMPI_COMM_WORLD_RANK) and writes its own log and exit status.
rank_cmd='r=${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-x}}
"$0" -m pytest -p no:cacheprovider --with-mpi -m mpi "$@" >"$LOGDIR/rank$r.log" 2>&1
echo $? >"$LOGDIR/rank$r.rc"'

echo "+ mpiexec -n $nprocs $python -m pytest --with-mpi -m mpi $*" >&2
set +e
LOGDIR=$logdir timeout --kill-after=30 "$timeout_s" \
    "${MPIEXEC:-mpiexec}" -n "$nprocs" bash -c "$rank_cmd" "$python" "$@"
launcher_rc=$?
set -e

status=0
if [[ $launcher_rc -eq 124 || $launcher_rc -eq 137 ]]; then
    echo "run_mpi.sh: timed out after ${timeout_s}s" >&2
    status=1
elif [[ $launcher_rc -ne 0 ]]; then
    echo "run_mpi.sh: mpiexec exited with status $launcher_rc" >&2
    status=1
fi
for ((r = 0; r < nprocs; r++)); do
    rc=$(cat "$logdir/rank$r.rc" 2>/dev/null || echo "none")
    failed=0
    if [[ $rc != 0 && $rc != 5 ]]; then
        failed=1
        status=1
    fi
    if [[ $r -eq 0 || $failed -eq 1 ]]; then
        echo "===== rank $r (pytest exit status: $rc) ====="
        cat "$logdir/rank$r.log" 2>/dev/null || echo "(no output)"
    fi
done
rc0=$(cat "$logdir/rank0.rc" 2>/dev/null || echo "none")
if [[ $status -eq 0 && $rc0 == 5 ]]; then
    echo "run_mpi.sh: no MPI tests collected in: $*"
fi
exit $status
