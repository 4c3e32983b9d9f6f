#!/usr/bin/env bash
# One CUDA check of classify on the lent GPU machine (run from the repo root; $OUT comes back).
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
step() { echo; echo "=== $(date +%T) $*"; }
{
step env
nvidia-smi -L; nproc; python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(), 'bf16', torch.cuda.is_bf16_supported())"
step "pytest (auto device = cuda)"
timeout 210 python3 -m pytest -q -n 12 -p no:cacheprovider --timeout 150 -W ignore::DeprecationWarning 2>&1 | tail -60
step "bench --quick --device cuda"
timeout 110 python3 -m experiments.bench --quick --device cuda --data .gpu/imdb --results $OUT/bench 2>&1 | tail -40
step "train: README recipe on a 5000-review slice, 1-minute budget, cuda, precision auto"
timeout 170 python3 -m classify.train --data .gpu/imdb --counterfactual .gpu/cf --limit 5000 --time-budget 1 \
  --output /tmp/r --quiet 2>&1 | tail -25
cp /tmp/r/test_metrics.json /tmp/r/config.json $OUT/ 2>/dev/null; tail -3 /tmp/r/metrics.jsonl
step "predict --json on cuda and on cpu, same run"
S=("It was not boring at all." "The acting was not superb." "The movie was terrible." "The film was wonderful.")
python3 -m classify.predict --model /tmp/r --device cuda --json "${S[@]}" > /tmp/p_cuda.jsonl; cat /tmp/p_cuda.jsonl
python3 -m classify.predict --model /tmp/r --device cpu --precision fp32 --json "${S[@]}" > /tmp/p_cpu.jsonl; cat /tmp/p_cpu.jsonl
step "evaluate on cuda (test slice 2000, counterfactual)"
timeout 90 python3 -m classify.evaluate --model /tmp/r --device cuda --counterfactual .gpu/cf --output /tmp/eval --quiet 2>&1 | tail -20
cp /tmp/eval/metrics.json $OUT/eval_metrics.json 2>/dev/null
step "export the cuda-trained run, predict with onnx"
timeout 60 python3 -m classify.export --model /tmp/r --output /tmp/onnx 2>&1 | tail -5
python3 -m classify.predict --model /tmp/onnx --backend onnx --json "${S[@]}" 2>&1 | tail -5
step done
} 2>&1 | tee $OUT/log.txt
