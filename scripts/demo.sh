#!/usr/bin/env bash
# The main job on a fresh machine: venv + install, generate click logs with a
# planted model, train logistic regression and a sparse DNN locally, evaluate
# both, and show predictions. Everything lands in ./demo-out (git-ignored).
#   ROWS=200000 scripts/demo.sh   for a quicker run (default 1,000,000 rows)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
mariana=.venv/bin/mariana
rows="${ROWS:-1000000}"
out=demo-out
mkdir -p "$out"
rm -rf "$out/model-lr" "$out/model-dnn"

echo "== 1/5 generate $rows training rows and $((rows / 5)) test rows (docs/synthetic-data.md)"
$mariana -q gen criteo --rows "$rows" --seed 1 --out "$out/train.tsv"
$mariana -q gen criteo --rows "$((rows / 5))" --seed 2 --out "$out/test.tsv"

echo "== 2/5 train logistic regression"
$mariana train --data "$out/train.tsv" --test-data "$out/test.tsv" --model lr --out "$out/model-lr"

echo "== 3/5 train the sparse DNN"
$mariana train --data "$out/train.tsv" --test-data "$out/test.tsv" --model dnn --out "$out/model-dnn"

echo "== 4/5 evaluate both on the test rows"
for m in lr dnn; do
  printf '%-4s ' "$m"; $mariana -q evaluate --model "$out/model-$m" --data "$out/test.tsv" --json
done

echo "== 5/5 predict: pCTR of the first 5 test rows (label in column 1)"
head -5 "$out/test.tsv" > "$out/sample.tsv"
paste <(cut -f1 "$out/sample.tsv") \
      <($mariana -q predict --model "$out/model-lr" --data "$out/sample.tsv") \
      <($mariana -q predict --model "$out/model-dnn" --data "$out/sample.tsv") \
  | awk 'BEGIN{printf "%-6s %-12s %-12s\n", "label", "pctr_lr", "pctr_dnn"} {printf "%-6s %-12s %-12s\n", $1, $2, $3}'
