#!/usr/bin/env bash
# One CUDA check of classify on the lent GPU machine (run from the repo root; $OUT comes back).
# The pytest suite (device auto = cuda) and a short recipe training on the GPU run side by side: the GPU is idle
# most of the time in the tests, the machine has 16 cores.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD
DEV=${DEV:-cuda}; BUDGET=${BUDGET:-1}
step() { echo; echo "=== $(date +%T) $*"; }
{
step env
nvidia-smi -L 2>/dev/null; nproc
python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.cuda.is_available() and torch.cuda.get_device_name(), 'bf16', torch.cuda.is_available() and torch.cuda.is_bf16_supported())"
python3 -c "import classify.train, classify.serve.app, classify.export, classify.predict, classify.evaluate, symspellpy, fastapi, onnxruntime; print('imports ok, onnxruntime', onnxruntime.__version__)" || exit 1
step "train (background): the README recipe on a 5000-review slice, --time-budget $BUDGET, $DEV, precision auto"
( timeout 300 python3 -m classify.train --data .gpu/imdb --counterfactual .gpu/cf --limit 5000 --time-budget "$BUDGET" \
    --device "$DEV" --seed 5 --output /tmp/r > "$OUT/train.log" 2>&1; echo "train rc=$?" >> "$OUT/train.log" ) &
TRAIN=$!
step "pytest (device auto)"
timeout 330 python3 -m pytest -q -n 8 -p no:cacheprovider --timeout 240 -rfE --tb=short -W ignore::DeprecationWarning \
  ${PYTEST_ARGS:-} > "$OUT/pytest.txt" 2>&1
echo "pytest rc=$?"; tail -40 "$OUT/pytest.txt"
step "waiting for the training"
wait $TRAIN; grep -v "^step" "$OUT/train.log" | tail -30
step "predict --json: $DEV (precision auto) and cpu fp32, same run"
S=("It was not boring at all." "The acting was not superb." "The movie was terrible." "The film was wonderful.")
python3 -m classify.predict --model /tmp/r --device "$DEV" --json "${S[@]}"
python3 -m classify.predict --model /tmp/r --device cpu --precision fp32 --json "${S[@]}"
step "evaluate on $DEV: the 2000-review test slice and the held-out pairs"
timeout 120 python3 -m classify.evaluate --model /tmp/r --device "$DEV" --counterfactual .gpu/cf --output /tmp/eval \
  --quiet 2>&1 | tail -25
step "export the run, predict with onnx (onnxruntime on the CPU)"
timeout 90 python3 -m classify.export --model /tmp/r --output /tmp/onnx 2>&1 | tail -5
python3 -m classify.predict --model /tmp/onnx --backend onnx --json "${S[@]}" 2>&1 | tail -5
(cd /tmp && tar czf "$OUT/run_small.tgz" r/config.json r/metrics.jsonl r/test_metrics.json eval/metrics.json eval/report.md 2>/dev/null)
step done
} 2>&1 | tee "$OUT/log.txt"
