#!/usr/bin/env bash
# The main job on a fresh machine: venv + install, generate click logs with a
# planted model, start a local cluster (an embedded redis-server and every
# pipeline service as its own process), train logistic regression and a
# sparse DNN through it (epoch 2 replays from the Redis sample cache),
# evaluate both, show predictions, serve the LR model over HTTP, train a
# new version and watch the server swap to it, stop everything. Output: ./demo-out.
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

echo "== 1/9 generate $rows training rows and $((rows / 5)) test rows (docs/synthetic-data.md)"
$mariana -q gen criteo --rows "$rows" --seed 1 --out "$out/train.tsv"
$mariana -q gen criteo --rows "$((rows / 5))" --seed 2 --out "$out/test.tsv"

echo "== 2/9 start a local cluster: redis, coordinator, 2 ps shards, loader, preprocess, 2 workers"
$mariana down >/dev/null 2>&1 || true  # a cluster left over from an interrupted demo
$mariana -q up --workers 2 --ps 2 --preprocess 1 >/dev/null
serve_pid=""
trap '[ -n "$serve_pid" ] && kill -TERM "$serve_pid" 2>/dev/null; wait 2>/dev/null; $mariana -q down >/dev/null' EXIT
$mariana status  # (its web UI shows the jobs, workers and models while the demo runs)
http=$(.venv/bin/python -c 'import json,sys; print(json.load(open(sys.argv[1]))["http"])' "$out/cluster/cluster.json")

echo "== 3/9 train logistic regression on the cluster, 2 epochs (the second from the cache)"
$mariana train --mode cluster --data "$out/train.tsv" --test-data "$out/test.tsv" --model lr --epochs 2 \
  --out "$out/model-lr"

echo "== 4/9 train the sparse DNN on the cluster"
$mariana train --mode cluster --data "$out/train.tsv" --test-data "$out/test.tsv" --model dnn \
  --out "$out/model-dnn"

echo "== 5/9 the cluster after both jobs"
$mariana status

echo "== 6/9 evaluate both on the test rows"
for m in lr dnn; do
  printf '%-4s ' "$m"; $mariana -q evaluate --model "$out/model-$m" --data "$out/test.tsv" --json
done

echo "== 7/9 predict: pCTR of the first 5 test rows (label in column 1)"
head -5 "$out/test.tsv" > "$out/sample.tsv"
paste <(cut -f1 "$out/sample.tsv") \
      <($mariana -q predict --model "$out/model-lr" --data "$out/sample.tsv") \
      <($mariana -q predict --model "$out/model-dnn" --data "$out/sample.tsv") \
  | awk 'BEGIN{printf "%-6s %-12s %-12s\n", "label", "pctr_lr", "pctr_dnn"} {printf "%-6s %-12s %-12s\n", $1, $2, $3}'

echo "== 8/9 serve the LR model over HTTP (2 worker processes; new versions announced on the cluster's Redis)"
redis_url=$(sed -n '/^\[redis\]/,/^\[/s/^url = "\(.*\)"/\1/p' "$MARIANA_CLUSTER__DIR/cluster.toml")
port=$(.venv/bin/python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
$mariana -q serve --model-dir "$out/model-lr" --port "$port" --workers 2 --redis-url "$redis_url" &
serve_pid=$!
ask() {  # POST the sample rows to /v1/predict; print the answer
  .venv/bin/python - "$port" "$out/sample.tsv" "$1" <<'PY'
import json, sys, time, urllib.request
from mariana.sparse.schema import criteo
port, sample, wait_for = sys.argv[1], sys.argv[2], sys.argv[3]
base = f"http://127.0.0.1:{port}"
deadline = time.monotonic() + 60
while True:  # the server answers once every worker listens and (if asked) serves `wait_for`
    try:
        ready = json.load(urllib.request.urlopen(base + "/readyz"))
        workers = ready["workers"]
        if workers["listening"] == workers["of"] and wait_for in ("", ready["model_version"]):
            break
    except OSError:
        pass
    if time.monotonic() > deadline:
        sys.exit(f"the server did not get ready (want version {wait_for or 'any'})")
    time.sleep(0.2)
cols = criteo().columns[1:]
rows = [dict(zip(cols, line.rstrip("\n").split("\t")[1:])) for line in open(sample)]
instances = [{k: v for k, v in r.items() if v != ""} for r in rows]
req = urllib.request.Request(base + "/v1/predict", json.dumps({"instances": instances}).encode(),
                             {"Content-Type": "application/json"})
answer = json.load(urllib.request.urlopen(req))
print(f"POST /v1/predict ({len(instances)} instances) -> model_version {answer['model_version']}")
print("  pctr " + " ".join(f"{p:.6f}" for p in answer["pctr"]))
PY
}
ask ""
echo "  mariana predict on the same rows: $($mariana -q predict --model "$out/model-lr" --data "$out/sample.tsv" | xargs printf '%.6f ')"

echo "== 9/9 train a new LR version on the test rows; it is announced and the server swaps to it"
$mariana -q train --data "$out/test.tsv" --model lr --out "$out/model-lr" --notify "$redis_url" >/dev/null
ask v000002
$mariana model list --model-dir "$out/model-lr"

echo "== summary"
.venv/bin/python - "$out" "$port" "$http" <<'PY'
import sys
from mariana.trainer import checkpoint
out, port, ui = sys.argv[1], sys.argv[2], sys.argv[3] + "/ui/"
print("models trained (AUC on the test rows):")
for kind in ("lr", "dnn"):
    m = checkpoint.overview(f"{out}/model-{kind}")
    for v in reversed(m["versions"]):
        auc = v["metrics"].get("auc")
        how = f"test AUC {auc:.4f}" if auc is not None else "no test AUC (trained on the test rows)"
        where = f"cluster job {v['job']}" if v.get("job") else "local"
        print(f"  {out + '/model-' + kind:<20} {v['version']}  {v['model']:<3}  {v['rows']:>9,} rows  "
              f"{where:<36} {how}"
              + ("   <- CURRENT" if v["current"] else ""))
served = checkpoint.current_version(f"{out}/model-lr")
print(f"served: {out}/model-lr {served} on http://127.0.0.1:{port}/v1/predict (stops with the demo)")
print(f"outputs: {out}/ (train.tsv, test.tsv, model-lr/, model-dnn/, cluster/logs/)")
print("try next:")
print(f"  .venv/bin/mariana up                 # a cluster that stays up (its web UI: the URL it prints)")
print(f"  .venv/bin/mariana train --mode cluster --data {out}/train.tsv --test-data {out}/test.tsv "
      f"--model dnn --out {out}/model-dnn")
print(f"  .venv/bin/mariana serve --model-dir {out}/model-lr --port 8080")
print(f"  .venv/bin/mariana evaluate --model {out}/model-dnn --data {out}/test.tsv")
print(f"  .venv/bin/mariana down               # stop that cluster")
print(f"the web UI at {ui} closes with the demo's cluster, now")
PY
