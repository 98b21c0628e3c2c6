#!/usr/bin/env bash
# The main job on a fresh machine: venv + install, generate click logs with a
# planted model, start a local cluster (an embedded redis-server and every
# pipeline service as its own process), train logistic regression and a
# sparse DNN through it (epoch 2 replays from the Redis sample cache),
# evaluate both, show predictions, stop the cluster. Output: ./demo-out.
#   ROWS=200000 scripts/demo.sh   for a quicker run (default 1,000,000 rows)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
mariana=.venv/bin/mariana
rows="${ROWS:-1000000}"
out=demo-out
mkdir -p "$out"
rm -rf "$out/model-lr" "$out/model-dnn"
export MARIANA_CLUSTER__DIR="$PWD/$out/cluster"  # up, status, train --mode cluster and down all use it

echo "== 1/7 generate $rows training rows and $((rows / 5)) test rows (docs/synthetic-data.md)"
$mariana -q gen criteo --rows "$rows" --seed 1 --out "$out/train.tsv"
$mariana -q gen criteo --rows "$((rows / 5))" --seed 2 --out "$out/test.tsv"

echo "== 2/7 start a local cluster: redis, coordinator, 2 ps shards, loader, preprocess, 2 workers"
$mariana down >/dev/null 2>&1 || true  # a cluster left over from an interrupted demo
$mariana -q up --workers 2 --ps 2 --preprocess 1 >/dev/null
trap '$mariana -q down >/dev/null' EXIT
$mariana status

echo "== 3/7 train logistic regression on the cluster, 2 epochs (the second from the cache)"
$mariana train --mode cluster --data "$out/train.tsv" --test-data "$out/test.tsv" --model lr --epochs 2 \
  --out "$out/model-lr"

echo "== 4/7 train the sparse DNN on the cluster"
$mariana train --mode cluster --data "$out/train.tsv" --test-data "$out/test.tsv" --model dnn \
  --out "$out/model-dnn"

echo "== 5/7 the cluster after both jobs"
$mariana status

echo "== 6/7 evaluate both on the test rows"
for m in lr dnn; do
  printf '%-4s ' "$m"; $mariana -q evaluate --model "$out/model-$m" --data "$out/test.tsv" --json
done

echo "== 7/7 predict: pCTR of the first 5 test rows (label in column 1)"
head -5 "$out/test.tsv" > "$out/sample.tsv"
paste <(cut -f1 "$out/sample.tsv") \
      <($mariana -q predict --model "$out/model-lr" --data "$out/sample.tsv") \
      <($mariana -q predict --model "$out/model-dnn" --data "$out/sample.tsv") \
  | awk 'BEGIN{printf "%-6s %-12s %-12s\n", "label", "pctr_lr", "pctr_dnn"} {printf "%-6s %-12s %-12s\n", $1, $2, $3}'
