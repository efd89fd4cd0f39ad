#!/usr/bin/env bash
# The batch lever (2026-12-02): EAGLE 3.1, soft labels, the token budget of run.sh's soft run
# (250 x 4 x 256) spent as 63 steps of 16 x 256, at lr 1e-3 and 2e-3 (warmup 4), one core each.
set -euo pipefail
export XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
core=0
for lr in 1e-3 2e-3; do
  taskset -c $core eagle-jax train --config train/configs/smollm2-eagle31.yaml \
    --data sharegpt --steps 63 --batch-size 16 --seq-len 256 --lr $lr --set warmup_steps=4 \
    --output-dir runs/lever-b16-lr$lr --eval-every 0 --set eval_at_start=false --no-progress \
    > runs/lever-b16-lr$lr.log 2>&1 &
  core=$((core + 1))
done
wait
unset XLA_FLAGS
python -m eagle_jax.benchmarks.teacher_forced --data sharegpt \
  --draft runs/lever-b16-lr1e-3/drafter --draft runs/lever-b16-lr2e-3/drafter \
  --output benchmarks/results/teacher-forced-batch-20261202.json
