#!/usr/bin/env bash
# The labels lever (2026-12-02): EAGLE 3.1, soft vs hard labels, same data, seed and steps,
# side by side on one core each; then the teacher-forced held-out measurement.
# Run from the repository root. Logs: <run>/train_log.jsonl (copied here as *-train_log.jsonl).
set -euo pipefail
export XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
core=0
for m in soft hard; do
  taskset -c $core eagle-jax train --config train/configs/smollm2-eagle31.yaml \
    --data sharegpt --steps 250 --seq-len 256 --labels $m --output-dir runs/lever-$m \
    --eval-every 0 --set eval_at_start=false --no-progress > runs/lever-$m.log 2>&1 &
  core=$((core + 1))
done
wait
unset XLA_FLAGS
python -m eagle_jax.benchmarks.teacher_forced --data sharegpt \
  --draft runs/lever-soft/drafter --draft runs/lever-hard/drafter \
  --output benchmarks/results/teacher-forced-labels-20261202.json
