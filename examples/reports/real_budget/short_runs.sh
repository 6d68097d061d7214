#!/usr/bin/env bash
# Issue items 1 and 3's short runs: the settings not measured yet (batch size, beta, lmbda), and why 200 steps of
# `uniform` did not make the student significantly better, measured on the 64-problem validation slice (never on the
# held-out set). Each run is one `hf-rockopd distill --eval_on validation`
# command sharing runs/val/shared (the teacher's validation reference, its top-64 cache, the base student's
# evaluation: made by the first run, about 40 min on 2 CPU cores, reused by the others). Every command resumes after a
# stop and does nothing once its run is finished, so the script can be run again until it is done.
#
#   bash examples/reports/real_budget/short_runs.sh            # all of them, in this order
#   bash examples/reports/real_budget/short_runs.sh b4 t512    # some of them
#
# steps<N>: the finished `uniform` run's checkpoint-N on the validation slice, nothing trained (the steps axis).
# t512:     20 steps with 512-token training rollouts (at 256, 57-80 % of rollouts were cut before their answer).
# b4:       20 steps with 4 rollouts a step instead of 2 (the gradient's noise).
# beta05:   20 steps of TRL's generalized JSD (beta 0.5, GKD's default) instead of the reverse KL; its evaluations
#           still report the reverse KL (eval_beta 1), so the divergence columns compare.
# lmbda05:  20 steps, half of them on GSM8K's own reference solutions instead of the student's rollouts (GKD's
#           default lmbda 0.5; the off-policy steps generate nothing).
set -euo pipefail
cd "$(dirname "$0")/../../.."
BIN=${BIN:-.venv/bin}
CONFIG=examples/configs/distill_qwen_long.yaml
RUN=${RUN:-runs/qwen-long/uniform}
common=(--config "$CONFIG" --eval_on validation --eval_cache_dir runs/val/shared --checkpoint_eval_problems 0
        --rock_policy uniform --rock_policy_kwargs '{}')
names=("$@")
[ ${#names[@]} -gt 0 ] || names=(b4 beta05 lmbda05 t512 steps100 steps200 steps50)
for name in "${names[@]}"; do
  echo "== $name ($(date -u +%H:%M:%S) UTC)"
  case "$name" in
    steps*)
      step=${name#steps}
      [ -d "$RUN/checkpoint-$step" ] || { echo "no $RUN/checkpoint-$step: finish the uniform run first" >&2; exit 2; }
      "$BIN/hf-rockopd" distill "${common[@]}" --max_steps "$step" --resume_from_checkpoint "$RUN/checkpoint-$step" \
        --output_dir "runs/val/uniform_step$step" ;;
    t512) "$BIN/hf-rockopd" distill "${common[@]}" --max_steps 20 --max_new_tokens 512 --output_dir runs/val/t512 ;;
    b4) "$BIN/hf-rockopd" distill "${common[@]}" --max_steps 20 --per_device_train_batch_size 4 --output_dir runs/val/b4 ;;
    beta05) "$BIN/hf-rockopd" distill "${common[@]}" --max_steps 20 --beta 0.5 --eval_beta 1.0 --output_dir runs/val/beta05 ;;
    lmbda05) "$BIN/hf-rockopd" distill "${common[@]}" --max_steps 20 --lmbda 0.5 --output_dir runs/val/lmbda05 ;;
    *) echo "unknown short run '$name' (b4, beta05, lmbda05, t512, steps<N>)" >&2; exit 2 ;;
  esac
done
