# Sourced by the sbatch recipes: `run_step srun ...` runs one job step so that the job survives
# its time limit and preemption, and resumes by itself.
#
# `#SBATCH --signal=B:TERM@60` sends SIGTERM to the batch shell only, 60 s before the time limit;
# bash would hold it until the step ends. run_step runs the step in the background, forwards the
# signal to every task of the job (`scancel --signal=TERM`: with --exit-signal-handler the ranks
# finish their iteration, save and exit), waits for the step, then requeues the job
# (`#SBATCH --requeue`): it starts again from the top and resumes from that checkpoint
# (--load = --save). A job cancelled for good (plain `scancel JOB`) is not requeued.
run_step() {
    local signalled=0 status=0 pid
    trap 'signalled=1; echo "recipe: SIGTERM to the batch shell: forwarding it to the tasks of job ${SLURM_JOB_ID}"; scancel --signal=TERM "${SLURM_JOB_ID}" || true' TERM
    "$@" &
    pid=$!
    wait "$pid" || status=$?
    while kill -0 "$pid" 2>/dev/null; do # the trap interrupted `wait`: the step still runs
        status=0
        wait "$pid" || status=$?
    done
    trap - TERM
    if ((signalled)) && [[ $(squeue -h -j "${SLURM_JOB_ID}" -o %T) == RUNNING ]]; then
        echo "recipe: step ended (status ${status}); requeueing job ${SLURM_JOB_ID}" \
            "(restart $((${SLURM_RESTART_COUNT:-0} + 1))): it resumes from the last checkpoint"
        scontrol requeue "${SLURM_JOB_ID}"
        exit 0
    fi
    return "$status"
}
