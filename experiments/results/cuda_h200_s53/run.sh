#!/usr/bin/env bash
# The CUDA check of the fifty-third session (one call on the lent H200; run from the repo root, $OUT comes back):
# the fifty-first session's check (../cuda_h200_s51/run.sh) again on the code with `--ngram-ellipsis 4` in the
# recipe, whose scope marking runs inside the model (NgramBag) and so on the GPU.
# .whl: the packages the image lacks (symspellpy, fastapi, pydantic, uvicorn, datasets, ...); .gpu: the IMDB
# parquet files (written uncompressed and xz'd, to fit the 64 MiB the tree may take) and the counterfactual pairs.
# Not run: tests/test_export.py (the image's onnxruntime 1.30 rejects torch 2.11's graph; 1.32 does not fit beside
# the data) and tests/test_distributed.py (torch 2.11's DDP lacks forward_sync_buffers; 2.13 is the floor).
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD
mkdir -p /tmp/data/imdb && tar xJf .gpu/imdb.tar.xz -C /tmp/data/imdb || exit 1
step() { echo; echo "=== $(date +%T) $*"; }
{
step env
nvidia-smi -L; nproc; lscpu | grep "Model name"
python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(), 'bf16', torch.cuda.is_bf16_supported())"
python3 -c "import classify.train, classify.serve.app, classify.predict, classify.evaluate, experiments.behaviour; print('imports ok')" || exit 1
step "train (background): the README command on the whole IMDB data, cuda, --finish-within 7.5, seed 7"
( timeout 480 python3 -m classify.train --data /tmp/data/imdb --counterfactual .gpu/cf \
    --output /tmp/r --finish-within 7.5 --seed 7 --device cuda > "$OUT/train.log" 2>&1
  echo "train rc=$?" >> "$OUT/train.log" ) &
TRAIN=$!
step "pytest (device auto = cuda), at most 240 s"
timeout 240 python3 -m pytest -v -n 6 -p no:cacheprovider -p no:benchmark --timeout 150 -rfE --tb=short \
  -W ignore::DeprecationWarning --ignore=tests/test_export.py --ignore=tests/test_distributed.py \
  > "$OUT/pytest_v.txt" 2>&1
echo "pytest rc=$?"; grep -cE " PASSED" "$OUT/pytest_v.txt"
grep -E "^(FAILED|ERROR) " "$OUT/pytest_v.txt" | head -40; tail -3 "$OUT/pytest_v.txt"
step "waiting for the training"
wait $TRAIN; grep -vE "^step|━" "$OUT/train.log" | tail -80
S=("It was not boring at all." "The acting was not superb." "I did not enjoy this movie." "The movie was terrible."
   "The film was wonderful." "I thought the movie would be great, but it wasn't."
   "I thought it would be boring, but it wasn't.")
step "predict --json on cuda (precision auto) and on cpu fp32, same run"
timeout 60 python3 -m classify.predict --model /tmp/r --device cuda --json "${S[@]}"
timeout 60 python3 -m classify.predict --model /tmp/r --device cpu --precision fp32 --json "${S[@]}"
step "behaviour suite of the GPU-trained run (CPU, fp32)"
timeout 90 python3 -m experiments.behaviour --runs /tmp/r --counterfactual .gpu/cf --threads 8 \
  --results "$OUT" --name behaviour-h200-seed7 2>&1 | tail -30
(cd /tmp && tar czf "$OUT/run_small.tgz" r/config.json r/metrics.jsonl r/test_metrics.json r/branch_validation.json)
step done
} 2>&1 | tee "$OUT/log.txt"
