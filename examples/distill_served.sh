#!/usr/bin/env bash
# The main job with the teacher served in another process (examples/configs/distill_qwen_served.yaml says why and how).
# Usage: examples/distill_served.sh [CONFIG] [HF_ROCKOPD_BIN_DIR]
set -euo pipefail
CONFIG=${1:-examples/configs/distill_qwen_served.yaml}
BIN=${2:-.venv/bin}
TEACHER=$(sed -n 's/^teacher: *//p' "$CONFIG")
URL=$(sed -n 's/^teacher_server_url: *//p' "$CONFIG")
TOP_K=$(sed -n 's/^teacher_top_k: *//p' "$CONFIG")
PORT=${URL##*:}

# 1. Once, with the teacher loaded: the held-out reference and its top-k cache (skipped when both exist).
"$BIN/hf-rockopd" teacher-cache --distill_config "$CONFIG" --top_k "$TOP_K"

# 2. The teacher in its own process, stopped whatever happens next.
"$BIN/hf-rockopd" serve-teacher --model "$TEACHER" --port "$PORT" --max_top_k "$TOP_K" &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 600); do
    curl -sf "$URL/health" >/dev/null && break
    kill -0 $SERVER 2>/dev/null || { echo "serve-teacher exited" >&2; exit 1; }
    sleep 1
done

# 3. Train and evaluate with only the student here.
"$BIN/hf-rockopd" distill --config "$CONFIG"
