# shellcheck shell=bash
# Helpers shared by jobs/slurm/train.sbatch and jobs/pbs/train.pbs (sourced, not run).
# Site settings live in jobs/site.sh; nothing here needs editing for a site.

# hpcdl_quote WORD...: the words as one line that a shell reads back as the same words,
# quoted only where needed ('...' or "..." where that suffices, for readability).
hpcdl_quote() {
    local word out="" q
    for word in "$@"; do
        if [[ "$word" =~ ^[A-Za-z0-9_./:=,+@%-]+$ ]]; then
            q=$word
        elif [[ "$word" != *"'"* ]]; then
            q="'$word'"
        elif [[ "$word" != *[\"\$\`\\!]* ]]; then
            q="\"$word\""
        else
            printf -v q '%q' "$word"
        fi
        out+="${out:+ }$q"
    done
    printf '%s\n' "$out"
}

# hpcdl_echo_cmd CMD...: print CMD on stderr, quoted so that it can be pasted into a shell.
hpcdl_echo_cmd() {
    echo "+ $(hpcdl_quote "$@")" >&2
}

# hpcdl_check_args PROG HINT ARGS...: refuse the training options that the job scripts set
# themselves: --out and --resume, and their abbreviations (--o, --res=..., which argparse
# takes for them). The script watches its own run file to decide whether to requeue; a
# run written elsewhere would end the chain silently. One line on stderr, status 2.
hpcdl_check_args() {
    local prog=$1 hint=$2 arg
    shift 2
    for arg in "$@"; do
        if [[ "$arg" =~ ^--(o|ou|out|r|re|res|resu|resum|resume)(=.*)?$ ]]; then
            echo "$prog: error: ${arg%%=*} among the training arguments: the job script sets --out RUN.h5 --resume auto itself (RUN: runs/<job name>.h5, which it watches to requeue); choose another run file with HPCDL_RUN ($hint), and continue a run by submitting the same job name again" >&2
            return 2
        fi
    done
}

# hpcdl_launch [--warn-after SECONDS] CMD...
# Run CMD (the launcher: srun or mpiexec) in the background and wait until it ends,
# forwarding SIGUSR1 and SIGTERM received by this batch shell to it.
# - Background + wait, not a foreground command: bash runs a trap only after the
#   foreground command returns, so a foreground launcher would never be told.
# - `wait` returns early whenever a trapped signal arrives, so wait again while the
#   launcher is alive; the last `wait` fetches its exit status.
# - A SIGUSR1 is held until the ranks can take it: until the file HPCDL_READY_FILE exists,
#   which rank 0 creates once every rank has installed its stop-signal handlers (a rank
#   that gets SIGUSR1 before that dies of it: no checkpoint, no requeue). Without
#   HPCDL_READY_FILE it is forwarded at once. SIGTERM is always forwarded at once (the
#   scheduler sends it to the ranks too; it stops the job either way).
# - A SIGUSR1 that reached the script before this function (HPCDL_SIGNAL already set by
#   the script's early trap) is held and forwarded the same way.
# - --warn-after: send this shell SIGUSR1 after SECONDS (the walltime timer for
#   schedulers without a warning signal); the timer is stopped when CMD ends.
# - --kill-after-failure (srun only): once srun reports a failed task, kill what is left of
#   the step with SIGKILL if it has not ended SECONDS later (hpcdl_watch_srun).
# Sets HPCDL_RC (CMD's exit status), HPCDL_SIGNAL (the first signal received: USR1,
# TERM, or empty), HPCDL_OUTPUT and HPCDL_OUTPUT_SIZE: the file this shell's stderr goes
# to (the job's output file, which CMD inherits: srun reports failed tasks there) and its
# size before CMD started, for hpcdl_srun_failure; both empty if it is not a regular file.
# shellcheck disable=SC2034  # HPCDL_RC, HPCDL_SIGNAL, HPCDL_OUTPUT*: read by the caller
hpcdl_launch() {
    local warn_after="" timer="" kill_after="" watcher=""
    while [[ "${1:-}" == --warn-after || "${1:-}" == --kill-after-failure ]]; do
        if [[ "$1" == --warn-after ]]; then warn_after=$2; else kill_after=$2; fi
        shift 2
    done
    HPCDL_OUTPUT=$(readlink -f "/proc/$$/fd/2" 2>/dev/null) || HPCDL_OUTPUT=""
    HPCDL_OUTPUT_SIZE=""
    if [[ -f "$HPCDL_OUTPUT" && -r "$HPCDL_OUTPUT" ]]; then
        HPCDL_OUTPUT_SIZE=$(wc -c < "$HPCDL_OUTPUT")
    else
        HPCDL_OUTPUT=""
    fi
    HPCDL_SIGNAL="${HPCDL_SIGNAL:-}"
    HPCDL_PID=""
    HPCDL_HELD=""
    trap '_hpcdl_forward USR1' USR1
    trap '_hpcdl_forward TERM' TERM
    "$@" &
    HPCDL_PID=$!
    if [[ -n "$HPCDL_SIGNAL" ]]; then  # arrived before the launcher existed
        _hpcdl_forward "$HPCDL_SIGNAL"
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
    if [[ -n "$kill_after" ]]; then
        hpcdl_watch_srun "$HPCDL_PID" "$kill_after" "$HPCDL_OUTPUT_SIZE" "$HPCDL_OUTPUT" &
        watcher=$!
    fi
    while kill -0 "$HPCDL_PID" 2>/dev/null; do
        if [[ -n "$HPCDL_HELD" ]]; then
            if [[ -e "$HPCDL_READY_FILE" ]]; then
                echo "$(date '+%F %T') ranks ready: forwarding the held SIG$HPCDL_HELD to the launcher (pid $HPCDL_PID)" >&2
                kill -"$HPCDL_HELD" "$HPCDL_PID" 2>/dev/null || true
                HPCDL_HELD=""
            else
                sleep 0.2
            fi
            continue
        fi
        wait "$HPCDL_PID" || true
    done
    HPCDL_RC=0
    wait "$HPCDL_PID" || HPCDL_RC=$?
    if [[ -n "$timer" ]]; then
        kill "$timer" 2>/dev/null || true
        wait "$timer" 2>/dev/null || true
    fi
    if [[ -n "$watcher" ]]; then
        kill "$watcher" 2>/dev/null || true
        wait "$watcher" 2>/dev/null || true
    fi
    trap - USR1 TERM
}

_hpcdl_forward() {
    [[ -n "$HPCDL_SIGNAL" ]] || HPCDL_SIGNAL=$1
    [[ -n "$HPCDL_PID" ]] || return 0
    if [[ "$1" == USR1 && -n "${HPCDL_READY_FILE:-}" && ! -e "$HPCDL_READY_FILE" ]]; then
        if [[ -z "$HPCDL_HELD" ]]; then
            echo "$(date '+%F %T') batch shell got SIGUSR1 before the ranks can take it: holding it until $HPCDL_READY_FILE exists" >&2
        fi
        HPCDL_HELD=USR1
        return 0
    fi
    echo "$(date '+%F %T') batch shell got SIG$1: forwarding it to the launcher (pid $HPCDL_PID)" >&2
    kill -"$1" "$HPCDL_PID" 2>/dev/null || true
}

# hpcdl_watch_srun PID SECONDS SIZE PATH (run in the background by hpcdl_launch): when srun
# (PID) reports a failed task in PATH after its first SIZE bytes, and has not ended SECONDS
# later, SIGKILL the step's tasks left on this node. srun's --kill-on-bad-exit ends the step
# as scancel does: SIGTERM, then SIGKILL after the cluster's KillWait (30 s by default).
# hpcdl's ranks take SIGTERM as a request to checkpoint at the next step boundary, which a
# rank waiting for a dead peer never reaches, so without this the job would last KillWait.
# slurmstepd handles no other signal request (scancel) while it waits out KillWait, so the
# tasks are killed by pid (scontrol listpids: this node's only; on the job's other nodes
# they end at KillWait). SECONDS leave a rank that noticed the failure itself the time to
# record it and abort.
hpcdl_watch_srun() {
    local pid=$1 grace=$2 size=$3 path=$4 tasks
    set +e +o pipefail  # tail ends by SIGPIPE or with srun: only grep's answer counts
    [[ -n "$path" ]] || return 0
    tail -c "+$(( size + 1 ))" -s 0.2 --pid="$pid" -f "$path" 2>/dev/null \
        | grep -m 1 -qE '^srun: error: [^ ]+: tasks? [0-9,-]+: ' || return 0
    sleep "$grace"
    kill -0 "$pid" 2>/dev/null || return 0
    # PID JOBID STEPID LOCALID GLOBALID: the tasks of srun's steps (numbered), not the batch shell's
    tasks=$(scontrol listpids "$SLURM_JOB_ID" 2>/dev/null | awk '$3 ~ /^[0-9]+$/ { print $1 }')
    [[ -n "$tasks" ]] || return 0
    echo "$(date '+%F %T') the step has not ended ${grace} s after a task failed: killing its tasks left on this node (SIGKILL)" >&2
    # shellcheck disable=SC2086  # one pid per word
    kill -KILL $tasks 2>/dev/null
}

# hpcdl_srun_failure SIZE PATH: the first task that srun reported failed in the output
# written after SIZE bytes of PATH (one step's), as "rank 1 on NODE (Killed)"; nothing
# if none. srun prints `srun: error: NODE: task(s) LIST: HOW` as the task exits reach it,
# so the task that failed first comes first; with --kill-on-bad-exit srun then kills the
# others, which it reports after it as Killed too: only the first line names the culprit.
# (Under srun, task N is MPI rank N.)
hpcdl_srun_failure() {
    local line
    [[ -n "$2" && -r "$2" ]] || return 0
    line=$(tail -c "+$(( $1 + 1 ))" "$2" | grep -m 1 -E '^srun: error: [^ ]+: tasks? [0-9,-]+: ') || return 0
    line=${line#srun: error: }
    local node=${line%%: *} rest=${line#*: }
    local tasks=${rest%%: *} how=${rest#*: }
    tasks=${tasks/#tasks /ranks }
    echo "${tasks/#task /rank } on $node ($how)"
}

# hpcdl_clean_shm SINCE: remove the MPICH shared-memory segments that a step killed since
# SINCE (seconds since the epoch) left in /dev/shm. MPICH creates /dev/shm/mpich_shm_<hash>_<n>
# in MPI_Init and removes it in MPI_Finalize; a rank that is killed (or a step that srun
# kills) leaves it behind. The name is derived from the PMI world (under srun: the job
# and step ids), so besides filling the node's memory, a stale segment makes a later step
# with the same name fail in MPI_Init ("Message truncated"). MPICH's name cannot be
# computed here, so a segment is taken to be this job's when all of:
# - owned by this user (the only ones it may remove anyway);
# - modified after SINCE, the time this job's step started: a segment of an earlier job
#   is left alone (it is gone with that job's processes, but not ours to judge);
# - used by no process: not mapped (/proc/*/maps) and not open (/proc/*/fd) by any
#   process this user can see, i.e. every one of its own. A concurrent job of the same
#   user that started later than ours has its live ranks mapping its segment, so it is
#   kept; what is left is stale whoever made it, and MPICH never reattaches to a segment
#   that no rank holds, other than by the name collision that breaks MPI_Init.
# Call it after the step has ended (srun returns once every task has exited).
hpcdl_clean_shm() {
    local since=$1 seg used removed=()
    local -a segs=()
    mapfile -t segs < <(find /dev/shm -maxdepth 1 -type f -name 'mpich_shm_*' -user "$(id -u)" \
        -newermt "@$since" 2>/dev/null)
    (( ${#segs[@]} )) || return 0
    used=$({
        grep -ho '/dev/shm/mpich_shm_[^ ]*' /proc/[0-9]*/maps
        find /proc/[0-9]*/fd -lname '/dev/shm/mpich_shm_*' -printf '%l\n'
    } 2>/dev/null | sort -u) || true  # some of /proc is not ours to read
    for seg in "${segs[@]}"; do
        if ! grep -qxF -- "$seg" <<< "$used" && rm -f -- "$seg"; then
            removed+=("${seg#/dev/shm/}")
        fi
    done
    if (( ${#removed[@]} )); then
        echo "$(date '+%F %T') removed the shared-memory segments the step left in /dev/shm: ${removed[*]}" >&2
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
