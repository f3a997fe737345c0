# shellcheck shell=bash
# Helpers shared by jobs/slurm/train.sbatch and jobs/pbs/train.pbs (sourced, not run).
# Site settings live in jobs/site.sh; nothing here needs editing for a site.

# hpcdl_echo_cmd CMD...: print CMD on stderr, quoted so that it can be pasted into a shell.
hpcdl_echo_cmd() {
    local quoted
    printf -v quoted '%q ' "$@"
    echo "+ ${quoted% }" >&2
}

# hpcdl_launch [--warn-after SECONDS] CMD...
# Run CMD (the launcher: srun or mpiexec) in the background and wait until it ends,
# forwarding SIGUSR1 and SIGTERM received by this batch shell to it.
# - Background + wait, not a foreground command: bash runs a trap only after the
#   foreground command returns, so a foreground launcher would never be told.
# - `wait` returns early whenever a trapped signal arrives, so wait again while the
#   launcher is alive; the last `wait` fetches its exit status.
# - --warn-after: send this shell SIGUSR1 after SECONDS (the walltime timer for
#   schedulers without a warning signal); the timer is stopped when CMD ends.
# Sets HPCDL_RC (CMD's exit status) and HPCDL_SIGNAL (the first signal forwarded:
# USR1, TERM, or empty).
# shellcheck disable=SC2034  # HPCDL_RC, HPCDL_SIGNAL: read by the caller
hpcdl_launch() {
    local warn_after="" timer=""
    if [[ "${1:-}" == --warn-after ]]; then
        warn_after=$2
        shift 2
    fi
    HPCDL_SIGNAL=""
    HPCDL_PID=""
    trap '_hpcdl_forward USR1' USR1
    trap '_hpcdl_forward TERM' TERM
    "$@" &
    HPCDL_PID=$!
    if [[ -n "$HPCDL_SIGNAL" ]]; then  # arrived before the launcher existed
        kill -"$HPCDL_SIGNAL" "$HPCDL_PID" 2>/dev/null || true
    fi
    if [[ -n "$warn_after" ]]; then
        echo "$(date '+%F %T') walltime timer: SIGUSR1 in ${warn_after} s" >&2
        # $$ is this batch shell, also inside the subshell. The subshell kills its own
        # sleep when it is stopped, so that no sleep outlives the job.
        (
            trap 'kill "$sleeper" 2>/dev/null; exit 0' TERM
            sleep "$warn_after" &
            sleeper=$!
            wait "$sleeper"
            echo "$(date '+%F %T') walltime timer fired" >&2
            kill -USR1 $$
        ) &
        timer=$!
    fi
    while kill -0 "$HPCDL_PID" 2>/dev/null; do
        wait "$HPCDL_PID" || true
    done
    HPCDL_RC=0
    wait "$HPCDL_PID" || HPCDL_RC=$?
    if [[ -n "$timer" ]]; then
        kill "$timer" 2>/dev/null || true
        wait "$timer" 2>/dev/null || true
    fi
    trap - USR1 TERM
}

_hpcdl_forward() {
    [[ -n "$HPCDL_SIGNAL" ]] || HPCDL_SIGNAL=$1
    if [[ -n "$HPCDL_PID" ]]; then
        echo "$(date '+%F %T') batch shell got SIG$1: forwarding it to the launcher (pid $HPCDL_PID)" >&2
        kill -"$1" "$HPCDL_PID" 2>/dev/null || true
    fi
}

# hpcdl_run_status RUN.h5: the run file's root attribute `status` (running, stopped,
# finished), or "unknown" if the file or the attribute is missing.
hpcdl_run_status() {
    HDF5_USE_FILE_LOCKING=FALSE python - "$1" 2>/dev/null <<'EOF' || echo unknown
import sys

import h5py

with h5py.File(sys.argv[1], "r") as f:
    status = f["/"].attrs["status"]
print(status.decode() if isinstance(status, bytes) else status)
EOF
}

# hpcdl_seconds [[[DD:]HH:]MM:]SS[.fff]: a PBS/Slurm duration in whole seconds.
hpcdl_seconds() {
    local total=0 part parts
    IFS=: read -r -a parts <<< "${1%%.*}"
    local mult=(1 60 3600 86400) n=${#parts[@]} i
    for (( i = 0; i < n; i++ )); do
        part=${parts[n - 1 - i]}
        [[ "$part" =~ ^[0-9]+$ ]] || return 1
        total=$(( total + 10#$part * mult[i] ))
    done
    echo "$total"
}

# hpcdl_pbs_attr JOBID NAME: one attribute of a PBS job from `qstat -f`, with its
# continuation lines (which qstat starts with a tab) joined. Empty if absent.
hpcdl_pbs_attr() {
    local out
    out=$(qstat -f "$1") || return 1
    awk -v name="$2" '
        /^\t/ { if (found) { sub(/^\t/, ""); val = val $0 }; next }
        found { exit }
        $1 == name && $2 == "=" { found = 1; val = $0; sub(/^[^=]*= /, "", val) }
        END { if (found) print val }' <<< "$out"
}
