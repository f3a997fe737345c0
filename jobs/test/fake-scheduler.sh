#!/usr/bin/env bash
# shellcheck disable=SC2030,SC2031  # each scenario's exports stay in its ( subshell ), on purpose
# Test the job scripts without a scheduler:   bash jobs/test/fake-scheduler.sh
# Exits non-zero if any check fails. Needs the MPICH mpiexec of the project's venv
# (`make demo`, or pip install '.[mpich]'), h5py, and setsid; uses a temporary directory.
#
# How it fakes a cluster:
# - jobs/slurm/train.sbatch and jobs/pbs/train.pbs run under plain bash with the
#   scheduler's variables set (SLURM_JOB_ID, SLURM_JOB_NAME, SLURM_NTASKS=2,
#   SLURM_SUBMIT_DIR, ... / PBS_JOBID, PBS_JOBNAME, PBS_NODEFILE, PBS_O_WORKDIR, NCPUS).
# - HPCDL_VENV points at a fake venv whose `activate` (which takes FAKE_ACTIVATE_SECONDS,
#   a slow start of the batch script) puts a stub directory in front of
#   the real venv on PATH. The stubs:
#     srun      drops its options and execs `mpiexec -n $SLURM_NTASKS` (same pid, so a
#               signal the batch shell forwards to "srun" reaches hydra, which forwards it
#               to the ranks, as srun does); with --mpi=none it starts the tasks as srun
#               under MpiDefault=none does: separate processes, each a one-rank MPI world;
#     scontrol, qsub, sbatch   log their arguments;
#     qstat     prints a `qstat -f` record with Resource_List.walltime=$FAKE_WALLTIME;
#     python    `python -m hpcdl.train ...` is a fake rank: it starts for
#               FAKE_STARTUP_SECONDS (0) without handlers (as python does while it imports),
#               then traps USR1/TERM; once every rank has, rank 0 creates HPCDL_READY_FILE
#               (as hpcdl.train does after a barrier). It prints "rank R got SIG", and rank
#               0 writes the run file with status "stopped" (signalled) or "finished"
#               (after FAKE_TRAIN_SECONDS), then exits FAKE_TRAIN_EXIT (0). Rank
#               FAKE_KILLED_RANK instead dies of SIGKILL once started, printing srun's report
#               of it first (hydra's own is not srun's). Anything else runs the real python (used to read the run file's status with h5py).
#   The stub python tests the signal plumbing (batch shell -> srun/mpiexec -> ranks) and
#   the requeue/resubmit decisions independently of hpcdl.train; its --out/--resume
#   handling is hpcdl.train's own business (tests/).
# - HPCDL_TEST_REAL=1 adds a scenario with the real `python -m hpcdl.train` (no python
#   stub): USR1 mid-run -> checkpoint, status "stopped", requeue; the "requeued" job
#   (same command, SLURM_RESTART_COUNT=1) resumes from the checkpoint and finishes.
# - The "walltime warning" is a `kill -USR1` to the batch shell (what Slurm's
#   --signal=B:USR1@N does); for PBS the script's own timer fires (short fake walltime).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
real_venv="${HPCDL_TEST_VENV:-$root/.venv}"
if [[ ! -x "$real_venv/bin/mpiexec" || ! -x "$real_venv/bin/python" ]]; then
    echo "fake-scheduler: needs $real_venv/bin/{python,mpiexec} (make demo)" >&2
    exit 2
fi

tmp=$(mktemp -d "${TMPDIR:-/tmp}/hpcdl-fake-sched.XXXXXX")
cleanup() { if [[ "${KEEP:-0}" == 1 ]]; then echo "kept $tmp"; else rm -rf "$tmp"; fi; }
trap cleanup EXIT
stubs=$tmp/stubs
submit=$tmp/submit
mkdir -p "$stubs" "$tmp/venv/bin" "$submit" "$tmp/logs"
ln -s "$root/jobs" "$submit/jobs"
# shellcheck disable=SC2016  # $PATH, $FAKE_* expand when activate is sourced
{
    printf 'PATH="%s:%s/bin:$PATH"; export PATH\n' "$stubs" "$real_venv"
    printf 'if [[ -n "${FAKE_ACTIVATE_SECONDS:-}" ]]; then : > "$FAKE_LOG_DIR/activating"; sleep "$FAKE_ACTIVATE_SECONDS"; fi\n'
} > "$tmp/venv/bin/activate"

cat > "$stubs/python" <<'EOF'
#!/usr/bin/env bash
# Fake rank for `python -m hpcdl.train`; the real python for anything else.
if [[ "${1:-}" != -m || "${2:-}" != hpcdl.train ]]; then
    exec "$REAL_PYTHON" "$@"
fi
shift 2
out=""
args=("$@")
for (( i = 0; i < ${#args[@]}; i++ )); do
    if [[ "${args[i]}" == --out ]]; then out=${args[i + 1]}; fi
done
rank=${PMI_RANK:-0}
size=${PMI_SIZE:-1}
sleep "${FAKE_STARTUP_SECONDS:-0}"  # a USR1 now kills this rank, as it kills python before its handlers
got=""
trap 'got=USR1' USR1
trap 'got=TERM' TERM
if [[ -n "${HPCDL_READY_FILE:-}" ]]; then  # hpcdl.train: a barrier, then rank 0 creates the file
    : > "$HPCDL_READY_FILE.rank$rank"
    if [[ "$rank" == 0 ]]; then
        while (( $(find "$(dirname "$HPCDL_READY_FILE")" -name "$(basename "$HPCDL_READY_FILE").rank*" | wc -l) < size )); do
            sleep 0.1
        done
        : > "$HPCDL_READY_FILE"
        rm -f "$HPCDL_READY_FILE".rank*
    fi
fi
echo "rank $rank started: $*"
if [[ "$rank" == 0 ]]; then echo "rank 0 HPCDL_CONTINUE=${HPCDL_CONTINUE:-}"; fi
if [[ "$rank" == "${FAKE_KILLED_RANK:-}" ]]; then
    echo "srun: error: $(hostname): task $rank: Killed" >&2
    kill -KILL $$
fi
sleep "${FAKE_TRAIN_SECONDS:-60}" &
sleeper=$!
wait "$sleeper" || true
if [[ -n "$got" ]]; then
    kill "$sleeper" 2>/dev/null || true
    echo "rank $rank got $got"
    status=stopped
else
    status=finished
fi
if [[ "$rank" == 0 && -n "$out" ]]; then
    "$REAL_PYTHON" -c 'import h5py, sys; h5py.File(sys.argv[1], "a").attrs["status"] = sys.argv[2]' "$out" "$status"
fi
exit "${FAKE_TRAIN_EXIT:-0}"
EOF

cat > "$stubs/srun" <<'EOF'
#!/usr/bin/env bash
# srun stand-in: log, drop srun's own options, become mpiexec (keeping this pid); with
# --mpi=none, start the tasks unconnected, as srun does under MpiDefault=none.
echo "srun $* SRUN_CPUS_PER_TASK=${SRUN_CPUS_PER_TASK:-}" >> "$FAKE_LOG_DIR/srun.log"
mpi=""
while [[ "${1:-}" == -* ]]; do
    if [[ "$1" == --mpi=* ]]; then mpi=${1#--mpi=}; fi
    shift
done
export SLURM_STEP_NUM_TASKS=$SLURM_NTASKS
if [[ "$mpi" != none ]]; then
    exec mpiexec -n "$SLURM_NTASKS" "$@"
fi
pids=()
for (( task = 0; task < SLURM_NTASKS; task++ )); do
    SLURM_PROCID=$task "$@" &
    pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
exit "$rc"
EOF

for cmd in scontrol qsub sbatch; do
    # shellcheck disable=SC2016  # $* expands when the stub runs
    printf '#!/usr/bin/env bash\necho "%s $*" >> "$FAKE_LOG_DIR/%s.log"\necho 999.fake\n' "$cmd" "$cmd" > "$stubs/$cmd"
done

cat > "$stubs/qstat" <<'EOF'
#!/usr/bin/env bash
# `qstat -f JOBID`, PBS Pro layout: 4-space attribute lines, tab-started continuations.
printf 'Job Id: %s\n' "$2"
printf '    Job_Name = %s\n' "$PBS_JOBNAME"
printf '    Resource_List.ncpus = 4\n'
printf '    Resource_List.select = 1:ncpus=4:mpiprocs=2:\n\tvntype=cray_compute\n'
printf '    Resource_List.walltime = %s\n' "${FAKE_WALLTIME:-00:30:00}"
printf '    queue = workq\n'
printf '    Account_Name = proj42\n'
EOF
chmod +x "$stubs"/*

export REAL_PYTHON="$real_venv/bin/python" FAKE_LOG_DIR="$tmp/logs" HPCDL_VENV="$tmp/venv"

failures=0
pass() { echo "  ok   $*"; }
fail() { echo "  FAIL $*"; failures=$((failures + 1)); }
# check DESCRIPTION COMMAND...: pass if COMMAND succeeds.
check() { local what=$1; shift; if "$@" > /dev/null 2>&1; then pass "$what"; else fail "$what"; fi; }
has() { grep -qF -- "$2" "$1"; }          # has FILE TEXT
count() { local n; n=$(grep -cF -- "$2" "$1" 2>/dev/null) || true; echo "${n:-0}"; }  # count FILE TEXT (0 if no FILE yet)
lacks_log() { [[ ! -s "$FAKE_LOG_DIR/$1.log" ]]; }

# start LOG SCRIPT ARGS...: run SCRIPT as a batch shell (own session, like a job) with the
# environment exported by the caller; sets job_pid.
start() {
    local log=$1; shift
    ( cd "$submit" && exec setsid bash "$@" ) > "$log" 2>&1 &
    job_pid=$!
    job_t0=$SECONDS
}
# wait_text LOG TEXT N SECONDS: wait until TEXT appears N times in LOG.
wait_text() {
    local deadline=$((SECONDS + $4))
    while (( $(count "$1" "$2") < $3 )); do
        if (( SECONDS > deadline )) || ! kill -0 "$job_pid" 2>/dev/null; then return 1; fi
        sleep 0.2
    done
}
# finish SECONDS: wait for the job (killing its session after SECONDS); sets job_rc.
finish() {
    local deadline=$((SECONDS + $1))
    while kill -0 "$job_pid" 2>/dev/null; do
        if (( SECONDS > deadline )); then
            echo "  (job $job_pid still running after $1 s: killing its session)"
            kill -KILL -- "-$job_pid" 2>/dev/null || true
            break
        fi
        sleep 0.2
    done
    job_rc=0
    wait "$job_pid" || job_rc=$?
    job_secs=$((SECONDS - job_t0))
}
reset_logs() { rm -f "$FAKE_LOG_DIR"/*.log; rm -rf "$submit/runs"; }
show_on_failure() { if (( failures > ${1:-0} )); then sed 's/^/      | /' "$2"; fi; }

slurm_env() {
    export SLURM_JOB_ID=4242 SLURM_JOB_NAME=$1 SLURM_NTASKS=2 SLURM_SUBMIT_DIR=$submit
    export SLURM_JOB_NODELIST=$HOSTNAME SLURM_CPUS_PER_TASK=1
}

echo "== syntax"
for f in "$root"/jobs/site.sh "$root"/jobs/lib.sh "$root"/jobs/sweep.sh \
         "$root"/jobs/slurm/train.sbatch "$root"/jobs/pbs/train.pbs "$root"/jobs/test/fake-scheduler.sh; do
    check "bash -n ${f#"$root"/}" bash -n "$f"
done
if command -v shellcheck > /dev/null; then
    check "shellcheck jobs/" shellcheck -x -s bash "$root"/jobs/*.sh "$root"/jobs/slurm/train.sbatch \
        "$root"/jobs/pbs/train.pbs "$root"/jobs/test/fake-scheduler.sh
else
    echo "  (shellcheck not installed: skipped)"
fi

check "Slurm's job log goes to runs/ (kept in every checkout), not the checkout's root" \
    bash -c "grep -qx '#SBATCH --output=runs/%x-%j.out' '$root/jobs/slurm/train.sbatch' && test -f '$root/runs/.gitignore'"
check "sbatch asks for --ntasks, not --ntasks-per-node (sbatch -n 2 must fit a 2-CPU node)" \
    bash -c "grep -qx '#SBATCH --ntasks=4' '$root/jobs/slurm/train.sbatch' && ! grep -q '^#SBATCH --ntasks-per-node' '$root/jobs/slurm/train.sbatch'"

echo "== lib.sh"
# shellcheck source=/dev/null
source "$root/jobs/lib.sh"
check "hpcdl_seconds 01:02:03 = 3723" test "$(hpcdl_seconds 01:02:03)" = 3723
check "hpcdl_seconds 08:09 = 489 (no octal)" test "$(hpcdl_seconds 08:09)" = 489
check "hpcdl_seconds 1:00:00:00 = 86400" test "$(hpcdl_seconds 1:00:00:00)" = 86400
check "hpcdl_seconds rejects junk" bash -c "source '$root/jobs/lib.sh'; ! hpcdl_seconds 1h"
check "hpcdl_quote: a shell reads back the same words" test \
    "$(bash -c "source '$root/jobs/lib.sh'; eval \"set -- \$(hpcdl_quote a 'b c' \"it's\" 'x\"\$y' '' 'k=[1,2]')\"; printf '<%s>' \"\$@\"")" = "<a><b c><it's><x\"\$y><><k=[1,2]>"
check "hpcdl_pbs_attr joins continuation lines" test \
    "$(PATH=$stubs:$PATH PBS_JOBNAME=x hpcdl_pbs_attr 1.fake Resource_List.select)" = "1:ncpus=4:mpiprocs=2:vntype=cray_compute"

check "hpcdl_srun_failure: the first task srun reports failed, after the offset" test \
    "$(printf 'srun: error: n1: task 0: Exited with exit code 1\nx\nsrun: error: n2: tasks 2-3: Killed\nsrun: error: n1: task 0: Killed\n' > "$tmp/srun.out"
       hpcdl_srun_failure 49 "$tmp/srun.out")" = "ranks 2-3 on n2 (Killed)"
# hpcdl_clean_shm SINCE removes this user's mpich_shm_* segments newer than SINCE that no process
# has open or mapped: here one stale, one held open, one older than SINCE (distinct names, removed after)
shm=/dev/shm/mpich_shm_hpcdltest$$
if [[ -d /dev/shm && -w /dev/shm ]]; then
    touch -d '-1 hour' "${shm}_old"
    since=$(( $(date +%s) - 60 ))
    touch "${shm}_stale" "${shm}_held"
    sleep 60 3< "${shm}_held" &
    holder=$!
    # the holder opens the file as it starts: on a loaded machine that may come after this line
    for _ in $(seq 100); do [[ -e /proc/$holder/fd/3 ]] && break; sleep 0.05; done
    hpcdl_clean_shm "$since" 2> "$tmp/clean-shm.out"
    check "hpcdl_clean_shm removes a stale segment of this job" test ! -e "${shm}_stale"
    check "hpcdl_clean_shm keeps a segment a process holds" test -e "${shm}_held"
    check "hpcdl_clean_shm keeps a segment older than the step" test -e "${shm}_old"
    check "hpcdl_clean_shm says what it removed" grep -qE "mpich_shm_hpcdltest$$_stale( |\$)" "$tmp/clean-shm.out"  # among others' stale ones
    kill "$holder"
    wait "$holder" 2>/dev/null || true
    rm -f "${shm}_old" "${shm}_stale" "${shm}_held"
fi

echo "== slurm: USR1 to the batch shell -> ranks checkpoint -> scontrol requeue"
reset_logs
log=$tmp/slurm-usr1.out
before=$failures
(
    slurm_env lr-0.1
    export FAKE_TRAIN_SECONDS=60
    start "$log" jobs/slurm/train.sbatch --config digits-cnn --set optimizer.lr=0.1
    if wait_text "$log" started 2 30; then kill -USR1 "$job_pid"; fi
    finish 40
    check "exit 0 (got $job_rc)" test "$job_rc" = 0
    check "stopped promptly (${job_secs} s < 30)" test "$job_secs" -lt 30
    check "echoes the launch command, srun --mpi=pmi2 (site.sh)" has "$log" \
        "+ srun --mpi=pmi2 --kill-on-bad-exit=1 --ntasks=2 python -m hpcdl.train --progress lines --out runs/lr-0.1.h5 --resume auto --config digits-cnn --set optimizer.lr=0.1"
    check "srun gets --cpus-per-task via SRUN_CPUS_PER_TASK" has "$FAKE_LOG_DIR/srun.log" "SRUN_CPUS_PER_TASK=1"
    check "srun --kill-on-bad-exit=1: a dead rank ends the step" has "$FAKE_LOG_DIR/srun.log" "--kill-on-bad-exit=1 "
    check "the ranks get HPCDL_CONTINUE: the sbatch line that continues the run" has "$log" \
        "rank 0 HPCDL_CONTINUE=sbatch --job-name=lr-0.1 --ntasks=2 jobs/slurm/train.sbatch --config digits-cnn --set optimizer.lr=0.1"
    check "the ready file is removed after the step" test ! -e "$submit/runs/lr-0.1.h5.ready-4242"
    check "rank 0 got USR1" has "$log" "rank 0 got USR1"
    check "rank 1 got USR1" has "$log" "rank 1 got USR1"
    check "run status read back: stopped" has "$log" "run status stopped, after SIGUSR1"
    check "scontrol requeue 4242" has "$FAKE_LOG_DIR/scontrol.log" "scontrol requeue 4242"
    exit "$failures"
) || failures=$((failures + $? - before))
show_on_failure "$before" "$log"

echo "== slurm: training finishes -> exit 0, no requeue"
reset_logs
log=$tmp/slurm-finished.out
before=$failures
(
    slurm_env finished
    export FAKE_TRAIN_SECONDS=1
    start "$log" jobs/slurm/train.sbatch --config digits-mlp
    finish 40
    check "exit 0 (got $job_rc)" test "$job_rc" = 0
    check "run status finished" has "$log" "run status finished"
    check "no requeue" lacks_log scontrol
    exit "$failures"
) || failures=$((failures + $? - before))
show_on_failure "$before" "$log"

echo "== slurm: USR1 with HPCDL_REQUEUE=0 and HPCDL_RUN -> stop, no requeue, the continue command"
reset_logs
log=$tmp/slurm-norequeue.out
before=$failures
(
    slurm_env norequeue
    export FAKE_TRAIN_SECONDS=60 HPCDL_REQUEUE=0 HPCDL_RUN=other/nr.h5 SLURM_CPUS_PER_TASK=2
    start "$log" jobs/slurm/train.sbatch --config digits-mlp --set 'model.widths=[8, 8]'
    if wait_text "$log" started 2 30; then kill -USR1 "$job_pid"; fi
    finish 40
    check "exit 0 (got $job_rc)" test "$job_rc" = 0
    check "ranks got USR1" test "$(count "$log" "got USR1")" = 2
    check "no requeue" lacks_log scontrol
    check "the ranks write HPCDL_RUN" has "$log" "--out other/nr.h5 --resume auto"
    check "says how to continue: HPCDL_RUN, name, ranks, threads, arguments" has "$log" \
        "stopped with a checkpoint; continue with: HPCDL_RUN=other/nr.h5 sbatch --job-name=norequeue --ntasks=2 --cpus-per-task=2 jobs/slurm/train.sbatch --config digits-mlp --set 'model.widths=[8, 8]'"
    exit "$failures"
) || failures=$((failures + $? - before))
show_on_failure "$before" "$log"

echo "== slurm: USR1 while the ranks start (no handlers yet) -> held until they are ready -> requeue"
reset_logs
log=$tmp/slurm-early.out
before=$failures
(
    slurm_env early
    export FAKE_TRAIN_SECONDS=60 FAKE_STARTUP_SECONDS=3
    start "$log" jobs/slurm/train.sbatch --config digits-mlp
    if wait_text "$log" "+ srun" 1 30; then kill -USR1 "$job_pid"; fi
    finish 40
    check "exit 0 (got $job_rc)" test "$job_rc" = 0
    check "the signal is held" has "$log" "before the ranks can take it: holding it"
    check "then forwarded" has "$log" "ranks ready: forwarding the held SIGUSR1"
    check "rank 0 got USR1" has "$log" "rank 0 got USR1"
    check "rank 1 got USR1" has "$log" "rank 1 got USR1"
    check "scontrol requeue 4242" has "$FAKE_LOG_DIR/scontrol.log" "scontrol requeue 4242"
    exit "$failures"
) || failures=$((failures + $? - before))
show_on_failure "$before" "$log"

echo "== slurm: USR1 while the batch script itself starts -> kept, held, forwarded -> requeue"
reset_logs
log=$tmp/slurm-earlier.out
before=$failures
(
    slurm_env earlier
    export FAKE_TRAIN_SECONDS=60 FAKE_ACTIVATE_SECONDS=2
    start "$log" jobs/slurm/train.sbatch --config digits-mlp
    deadline=$((SECONDS + 30))
    while [[ ! -e "$FAKE_LOG_DIR/activating" ]] && (( SECONDS < deadline )); do sleep 0.1; done
    kill -USR1 "$job_pid"
    finish 40
    rm -f "$FAKE_LOG_DIR/activating"
    check "exit 0 (got $job_rc)" test "$job_rc" = 0
    check "rank 0 got USR1" has "$log" "rank 0 got USR1"
    check "rank 1 got USR1" has "$log" "rank 1 got USR1"
    check "scontrol requeue 4242" has "$FAKE_LOG_DIR/scontrol.log" "scontrol requeue 4242"
    exit "$failures"
) || failures=$((failures + $? - before))
show_on_failure "$before" "$log"

echo "== slurm: --out/--resume among the arguments -> refused, one line, exit 2, nothing launched"
reset_logs
before=$failures
(
    slurm_env own-out
    export FAKE_TRAIN_SECONDS=1
    i=0
    for bad in "--out elsewhere.h5" "--out=elsewhere.h5" "--o elsewhere.h5" "--resume auto" "--res=auto"; do
        i=$((i + 1))
        log=$tmp/slurm-out-$i.out
        read -r -a bad_args <<< "$bad"
        start "$log" jobs/slurm/train.sbatch --config digits-mlp "${bad_args[@]}"
        finish 20
        check "$bad: exit 2 (got $job_rc)" test "$job_rc" = 2
        check "$bad: one line naming the option and HPCDL_RUN" test "$(grep -c "train.sbatch: error: ${bad_args[0]%%=*} among the training arguments.*HPCDL_RUN" "$log")" = 1
        check "$bad: nothing launched" lacks_log srun
    done
    exit "$failures"
) || failures=$((failures + $? - before))
show_on_failure "$before" "$tmp/slurm-out-1.out"

echo "== slurm: TERM (scancel) -> forwarded, no requeue"
reset_logs
log=$tmp/slurm-term.out
before=$failures
(
    slurm_env term
    export FAKE_TRAIN_SECONDS=60
    start "$log" jobs/slurm/train.sbatch --config digits-mlp
    if wait_text "$log" started 2 30; then kill -TERM "$job_pid"; fi
    finish 40
    check "exit 0 (got $job_rc)" test "$job_rc" = 0
    check "ranks got TERM" test "$(count "$log" "got TERM")" = 2
    check "no requeue" lacks_log scontrol
    exit "$failures"
) || failures=$((failures + $? - before))
show_on_failure "$before" "$log"

echo "== slurm: failing step -> its exit status, no requeue"
reset_logs
log=$tmp/slurm-fail.out
before=$failures
(
    slurm_env fail
    export FAKE_TRAIN_SECONDS=1 FAKE_TRAIN_EXIT=3
    start "$log" jobs/slurm/train.sbatch --config digits-mlp
    finish 40
    check "exit 3 (got $job_rc)" test "$job_rc" = 3
    check "no requeue" lacks_log scontrol
    exit "$failures"
) || failures=$((failures + $? - before))
show_on_failure "$before" "$log"

echo "== slurm: a rank is killed -> the step ends at once, the job's line names the rank, no requeue"
reset_logs
log=$tmp/slurm-killed.out
before=$failures
(
    slurm_env killed
    export FAKE_TRAIN_SECONDS=60 FAKE_KILLED_RANK=1
    start "$log" jobs/slurm/train.sbatch --config digits-mlp
    finish 40
    check "a failure's exit status (got $job_rc)" test "$job_rc" != 0
    check "ended promptly (${job_secs} s < 15)" test "$job_secs" -lt 15
    check "the step's line names the killed rank" grep -qE \
        "^[0-9-]+ [0-9:]+ step exit $job_rc, run status [a-z]+, first failed: rank 1 on $(hostname) \(Killed\)$" "$log"
    check "no requeue" lacks_log scontrol
    exit "$failures"
) || failures=$((failures + $? - before))
show_on_failure "$before" "$log"

echo "== slurm: USR1 after HPCDL_MAX_RESTARTS requeues -> exit 1, no requeue"
reset_logs
log=$tmp/slurm-max.out
before=$failures
(
    slurm_env max
    export FAKE_TRAIN_SECONDS=60 SLURM_RESTART_COUNT=3 HPCDL_MAX_RESTARTS=3
    start "$log" jobs/slurm/train.sbatch --config digits-mlp
    if wait_text "$log" started 2 30; then kill -USR1 "$job_pid"; fi
    finish 40
    check "exit 1 (got $job_rc)" test "$job_rc" = 1
    check "no requeue" lacks_log scontrol
    exit "$failures"
) || failures=$((failures + $? - before))
show_on_failure "$before" "$log"

pbs_env() {
    printf '%s\n' "$HOSTNAME" "$HOSTNAME" > "$tmp/nodefile"
    export PBS_JOBID=77.fake PBS_JOBNAME=$1 PBS_NODEFILE=$tmp/nodefile PBS_O_WORKDIR=$submit NCPUS=4
    unset OMP_NUM_THREADS OPENBLAS_NUM_THREADS
}

echo "== pbs: walltime timer (qstat walltime - HPCDL_MARGIN) -> ranks checkpoint -> qsub again"
reset_logs
log=$tmp/pbs-timer.out
before=$failures
(
    pbs_env pbs-lr
    export FAKE_TRAIN_SECONDS=60 FAKE_WALLTIME=00:00:07 HPCDL_MARGIN=4
    export HPCDL_ARGS="--config digits-cnn --set optimizer.lr=0.1"
    start "$log" jobs/pbs/train.pbs
    finish 40
    check "exit 0 (got $job_rc)" test "$job_rc" = 0
    check "timer armed for 7 - 4 = 3 s" has "$log" "SIGUSR1 in 3 s"
    check "NCPUS=4 over 2 ranks/node: 2 threads/rank" has "$log" "2 threads/rank"
    check "arguments from HPCDL_ARGS, echoed launch command" has "$log" \
        "+ mpiexec -n 2 --hostfile $tmp/nodefile python -m hpcdl.train --progress lines --out runs/pbs-lr.h5 --resume auto --config digits-cnn --set optimizer.lr=0.1"
    check "rank 0 got USR1" has "$log" "rank 0 got USR1"
    check "rank 1 got USR1" has "$log" "rank 1 got USR1"
    check "run status stopped" has "$log" "run status stopped, after SIGUSR1"
    check "qsub with same name, resources, args, run and restart count" has "$FAKE_LOG_DIR/qsub.log" \
        "qsub -N pbs-lr -l select=1:ncpus=4:mpiprocs=2:vntype=cray_compute -l walltime=00:00:07 -q workq -A proj42 -v HPCDL_ARGS='--config digits-cnn --set optimizer.lr=0.1',HPCDL_RUN=runs/pbs-lr.h5,HPCDL_RESTARTS=1,HPCDL_MARGIN=4 jobs/pbs/train.pbs"
    check "the ranks get HPCDL_CONTINUE: the qsub line that continues the run" has "$log" \
        "rank 0 HPCDL_CONTINUE=qsub -N pbs-lr -l select=1:ncpus=4:mpiprocs=2:vntype=cray_compute -l walltime=00:00:07 -q workq -A proj42 -v \"HPCDL_ARGS='--config digits-cnn --set optimizer.lr=0.1',HPCDL_RUN=runs/pbs-lr.h5,HPCDL_MARGIN=4\" jobs/pbs/train.pbs"
    exit "$failures"
) || failures=$((failures + $? - before))
show_on_failure "$before" "$log"
if [[ -s "$FAKE_LOG_DIR/qsub.log" ]]; then sed 's/^/      qsub.log: /' "$FAKE_LOG_DIR/qsub.log"; fi

echo "== pbs: walltime timer fires while the ranks start -> held until they are ready -> qsub again"
reset_logs
log=$tmp/pbs-early.out
before=$failures
(
    pbs_env pbs-early
    export FAKE_TRAIN_SECONDS=60 FAKE_STARTUP_SECONDS=4 HPCDL_WALLTIME=5 HPCDL_MARGIN=4
    export HPCDL_ARGS="--config digits-mlp"
    start "$log" jobs/pbs/train.pbs
    finish 40
    check "exit 0 (got $job_rc)" test "$job_rc" = 0
    check "the signal is held" has "$log" "before the ranks can take it: holding it"
    check "rank 0 got USR1" has "$log" "rank 0 got USR1"
    check "rank 1 got USR1" has "$log" "rank 1 got USR1"
    check "qsub again" has "$FAKE_LOG_DIR/qsub.log" "qsub -N pbs-early"
    exit "$failures"
) || failures=$((failures + $? - before))
show_on_failure "$before" "$log"

echo "== pbs: --out in HPCDL_ARGS -> refused, one line, exit 2"
reset_logs
log=$tmp/pbs-out.out
before=$failures
(
    pbs_env pbs-out
    export FAKE_TRAIN_SECONDS=1 HPCDL_WALLTIME=600 HPCDL_ARGS="--config digits-mlp --out=x.h5"
    start "$log" jobs/pbs/train.pbs
    finish 20
    check "exit 2 (got $job_rc)" test "$job_rc" = 2
    check "one line naming --out and HPCDL_RUN" test "$(grep -c "train.pbs: error: --out among the training arguments.*HPCDL_RUN" "$log")" = 1
    check "nothing launched" bash -c "! grep -q 'rank 0 started' '$log'"
    exit "$failures"
) || failures=$((failures + $? - before))
show_on_failure "$before" "$log"

echo "== pbs: training finishes before the timer -> timer stopped, no qsub"
reset_logs
log=$tmp/pbs-finished.out
before=$failures
(
    pbs_env pbs-done
    export FAKE_TRAIN_SECONDS=1 HPCDL_WALLTIME=987654 HPCDL_MARGIN=120 HPCDL_ARGS="--config ignored"
    start "$log" jobs/pbs/train.pbs --config digits-mlp --set train.epochs=1
    finish 40
    check "exit 0 (got $job_rc)" test "$job_rc" = 0
    check "ended promptly (${job_secs} s < 20)" test "$job_secs" -lt 20
    check "\"\$@\" wins over HPCDL_ARGS" has "$log" "--resume auto --config digits-mlp --set train.epochs=1"
    check "HPCDL_WALLTIME override used" has "$log" "SIGUSR1 in 987534 s"
    check "no timer sleep left behind" bash -c '! pgrep -f "sleep 98753[4]"'
    check "run status finished" has "$log" "run status finished"
    check "no qsub" lacks_log qsub
    exit "$failures"
) || failures=$((failures + $? - before))
show_on_failure "$before" "$log"

if [[ "${HPCDL_TEST_REAL:-0}" == 1 ]]; then
    echo "== slurm, real hpcdl.train: USR1 -> checkpoint -> requeue -> resume -> finished"
    reset_logs
    mkdir -p "$tmp/stubs-real" "$tmp/venv-real/bin"
    ln -sf "$stubs/srun" "$stubs/scontrol" "$tmp/stubs-real/"
    # shellcheck disable=SC2016  # $PATH expands when activate is sourced
    printf 'PATH="%s:%s/bin:$PATH"; export PATH\n' "$tmp/stubs-real" "$real_venv" > "$tmp/venv-real/bin/activate"
    log=$tmp/slurm-real.out
    before=$failures
    (
        slurm_env real
        export HPCDL_VENV=$tmp/venv-real
        start "$log" jobs/slurm/train.sbatch --config digits-mlp --set train.epochs=600
        if wait_text "$log" "step " 3 60; then sleep 2; kill -USR1 "$job_pid"; fi
        finish 120
        check "first job: exit 0 (got $job_rc)" test "$job_rc" = 0
        check "first job: stopped by SIGUSR1 with a checkpoint" has "$log" "stopped by SIGUSR1"
        check "first job: run status stopped, requeued" has "$FAKE_LOG_DIR/scontrol.log" "scontrol requeue 4242"
        export SLURM_RESTART_COUNT=1
        start "$log.2" jobs/slurm/train.sbatch --config digits-mlp --set train.epochs=600
        finish 300
        cat "$log.2" >> "$log"
        check "requeued job: exit 0 (got $job_rc)" test "$job_rc" = 0
        check "requeued job: resumed from the checkpoint" has "$log.2" "resuming from runs/real.ckpt-"
        check "requeued job: run status finished" has "$log.2" "run status finished"
        check "requeued job: not requeued again" test "$(count "$FAKE_LOG_DIR/scontrol.log" requeue)" = 1
        exit "$failures"
    ) || failures=$((failures + $? - before))
    show_on_failure "$before" "$log"

    echo "== slurm, real hpcdl.train, srun --mpi=none: unconnected ranks refused, one line, exit 2"
    reset_logs
    log=$tmp/slurm-nopmi.out
    before=$failures
    (
        slurm_env nopmi
        export HPCDL_VENV=$tmp/venv-real HPCDL_SRUN_MPI=none
        start "$log" jobs/slurm/train.sbatch --config digits-mlp --set train.steps=5
        finish 120
        check "exit 2 (got $job_rc)" test "$job_rc" = 2
        check "srun --mpi=none" has "$FAKE_LOG_DIR/srun.log" "srun --mpi=none --kill-on-bad-exit=1 --ntasks=2"
        # each task refuses alike; the first to exit may end the other first (--kill-on-bad-exit)
        refused=$(grep -c "^hpcdl.train: error: srun started 2 processes (SLURM_STEP_NUM_TASKS=2) but MPI sees 1 rank.*HPCDL_SRUN_MPI" "$log")
        check "a task (or both): one line naming both counts and the PMI setting ($refused)" test "$refused" -ge 1
        check "no traceback" bash -c "! grep -q Traceback '$log'"
        check "no training, no run file" bash -c "! grep -q '^step ' '$log' && test ! -e '$submit/runs/nopmi.h5'"
        exit "$failures"
    ) || failures=$((failures + $? - before))
    show_on_failure "$before" "$log"
fi

echo "== sweep.sh"
reset_logs
log=$tmp/sweep.out
before=$failures
(
    cd "$submit"
    export PATH="$stubs:$PATH"
    HPCDL_SCHEDULER=slurm bash jobs/sweep.sh optimizer.lr 0.01 0.1 -- --config digits-cnn > "$log" 2>&1
    HPCDL_SCHEDULER=pbs HPCDL_SWEEP=cnn bash jobs/sweep.sh model.name cnn mlp -- --config digits-cnn >> "$log" 2>&1
    check "slurm: two jobs submitted" test "$(wc -l < "$FAKE_LOG_DIR/sbatch.log")" = 2
    check "slurm: own job name and --set" has "$FAKE_LOG_DIR/sbatch.log" \
        "sbatch --job-name=optimizer.lr-0.01 jobs/slurm/train.sbatch --config digits-cnn --set optimizer.lr=0.01"
    check "pbs: own job name and HPCDL_ARGS" has "$FAKE_LOG_DIR/qsub.log" \
        "qsub -N cnn-mlp -v HPCDL_ARGS='--config digits-cnn --set model.name=mlp' jobs/pbs/train.pbs"
    check "usage error without --" bash -c "! bash jobs/sweep.sh optimizer.lr 0.1"
    check "--out refused at submission, nothing submitted" bash -c \
        "bash jobs/sweep.sh optimizer.lr 0.1 -- --config x --out y.h5 2>&1 | grep -q 'sweep.sh: error: --out' && test \$(wc -l < '$FAKE_LOG_DIR/sbatch.log') = 2"
    exit "$failures"
) || failures=$((failures + $? - before))
show_on_failure "$before" "$log"

if (( failures > 0 )); then
    echo "fake-scheduler: $failures check(s) failed (KEEP=1 keeps $tmp)"
    exit 1
fi
echo "fake-scheduler: all checks passed"
