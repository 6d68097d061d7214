#!/usr/bin/env bash
# The last step of the real-budget run, once both policies are trained and evaluated on the 250 held-out problems:
# the verdict (result.json, its details, the curves), each run's records, both model cards and rock_online's answers,
# copied into this folder and model_cards/examples/. It reads runs/qwen-long/{uniform,rock_online} and changes
# nothing there but the verdict in each run's run_report.json. Run it from anywhere, again whenever a run changes.
#
#   bash examples/reports/real_budget/finish.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
BIN=${BIN:-.venv/bin}
HERE=examples/reports/real_budget
# Other folders for a dry run (RUNS=/tmp/runs REPORT=/tmp/report CARDS=/tmp/cards): the defaults are the real ones.
RUNS=${RUNS:-runs/qwen-long}
REPORT=${REPORT:-$HERE}
CARDS=${CARDS:-model_cards/examples}
mkdir -p "$REPORT/uniform" "$REPORT/rock_online" "$CARDS"
for run in uniform rock_online; do
  [ -f "$RUNS/$run/eval_after.json" ] || {
    echo "$RUNS/$run/eval_after.json is missing: finish that run first (README, 'What is left')" >&2; exit 2; }
done

# result.json, result_details.json and curves.png, written straight into the report; the verdict also goes into
# each run's run_report.json, which the cards read.
"$BIN/hf-rockopd" verdict --runs "$RUNS/uniform" "$RUNS/rock_online" --out "$REPORT/result.json"

for name in run_report.json eval_after.json checkpoint_evals.jsonl rock_tokens.json; do
  cp "$RUNS/rock_online/$name" "$REPORT/rock_online/$name"
done
cp "$RUNS/uniform/run_report.json" "$REPORT/uniform/run_report.json"

for run in uniform rock_online; do
  "$BIN/hf-rockopd" card "$RUNS/$run" --out "$CARDS/qwen2.5-coder-0.5b-instruct-opd-$run.md"
done

"$BIN/python" "$HERE/answers.py" --before "$RUNS/uniform/eval_before.json" \
  --after "rock_online=$RUNS/rock_online/eval_after.json" \
  --teacher "$RUNS/shared/teacher_reference.json" --tokenizer Qwen/Qwen2.5-Coder-1.5B-Instruct \
  > "$REPORT/rock_online/answers.txt"
echo "done: read $REPORT/result.json, $REPORT/curves.png, $CARDS/qwen2.5-coder-0.5b-instruct-opd-*.md and"
echo "$REPORT/rock_online/answers.txt before writing the README's tables"
