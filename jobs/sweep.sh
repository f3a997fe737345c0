#!/usr/bin/env bash
# Submit one training job per value of a config key, each with its own job name and so
# its own run file runs/<name>.h5. Run from the repository root:
#   jobs/sweep.sh KEY VALUE... -- TRAIN_ARGS...
#   jobs/sweep.sh optimizer.lr 0.01 0.03 0.1 -- --config digits-cnn
#   HPCDL_SWEEP=cnn-lr jobs/sweep.sh optimizer.lr 0.01 0.1 -- --config digits-cnn --set train.epochs=20
# Values are read as TOML; a bare word is a string (jobs/sweep.sh optimizer.name adam sgd -- ...).
# Each value gives `--set KEY=VALUE` and the job name <sweep>-<value>, where <sweep> is
# HPCDL_SWEEP (default: KEY). Resubmitting the same sweep continues unfinished runs.
# Scheduler: HPCDL_SCHEDULER=slurm|pbs (default: whichever of sbatch/qsub is on PATH).
# Extra submission options: HPCDL_SUBMIT_ARGS (word-split), e.g. "--time=04:00:00".
# HPCDL_DRY_RUN=1 prints the commands instead of submitting.
set -euo pipefail

usage() { sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
(( $# >= 3 )) || usage
key=$1
shift
values=()
while (( $# > 0 )) && [[ "$1" != -- ]]; do
    values+=("$1")
    shift
done
[[ "${1:-}" == -- && ${#values[@]} -gt 0 ]] || usage
shift
train_args=("$@")
# shellcheck source=jobs/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
# refused now rather than when each job starts: the job scripts set --out/--resume themselves
hpcdl_check_args sweep.sh "each job's run file is runs/<sweep>-<value>.h5" "${train_args[@]}" || exit 2

scheduler="${HPCDL_SCHEDULER:-}"
if [[ -z "$scheduler" ]]; then
    if command -v sbatch > /dev/null; then scheduler=slurm
    elif command -v qsub > /dev/null; then scheduler=pbs
    else echo "sweep.sh: neither sbatch nor qsub on PATH; set HPCDL_SCHEDULER" >&2; exit 2
    fi
fi
read -r -a submit_args <<< "${HPCDL_SUBMIT_ARGS:-}"
sweep="${HPCDL_SWEEP:-$key}"

for value in "${values[@]}"; do
    # Job names: letters, digits, . _ - only (PBS also wants a leading letter).
    name=$(printf '%s-%s' "$sweep" "$value" | tr -c 'A-Za-z0-9._-' '_')
    case $scheduler in
        slurm)
            cmd=(sbatch --job-name="$name" "${submit_args[@]}" jobs/slurm/train.sbatch
                 "${train_args[@]}" --set "$key=$value") ;;
        pbs)
            args="${train_args[*]} --set $key=$value"
            if [[ "$args" =~ [\'\"] ]]; then
                echo "sweep.sh: quotes cannot travel in HPCDL_ARGS under PBS: $args" >&2
                exit 2
            fi
            cmd=(qsub -N "$name" "${submit_args[@]}" -v "HPCDL_ARGS='$args'" jobs/pbs/train.pbs) ;;
        *)
            echo "sweep.sh: unknown HPCDL_SCHEDULER=$scheduler (slurm or pbs)" >&2
            exit 2 ;;
    esac
    printf -v shown '%q ' "${cmd[@]}"
    echo "+ ${shown% }"
    if [[ "${HPCDL_DRY_RUN:-0}" != 1 ]]; then
        "${cmd[@]}"
    fi
done
