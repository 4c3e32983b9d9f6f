#!/usr/bin/env bash
# Second call of the fifty-first session: the tests that failed on the GPU for reasons other than torch 2.11's DDP,
# with onnxruntime 1.32 (the project's floor) carried in place of the image's 1.30.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  .gpu2/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
{
python3 -c "import torch, onnx, onnxscript, onnxruntime as o; print(torch.__version__, 'onnx', onnx.__version__, 'onnxscript', onnxscript.__version__, 'onnxruntime', o.__version__, o.__file__)"
timeout 230 python3 -m pytest -v -n 8 -p no:cacheprovider -p no:benchmark --timeout 200 -rfE --tb=short \
  -W ignore::DeprecationWarning tests/test_export.py \
  tests/test_experiments.py::test_branch_memory_rebuilds_the_runs_branch_and_scores_each_variant \
  tests/test_serve_process.py::test_open_loop_load_test_records_capacity_levels_and_efficiency \
  tests/test_serve_process.py::test_open_loop_load_test_drives_an_onnx_server_and_its_model_alone > "$OUT/pytest_v.txt" 2>&1
echo "pytest rc=$?"; grep -E "(PASSED|FAILED|ERROR|SKIPPED) " "$OUT/pytest_v.txt" | sed 's/^\[gw[0-9]*\] \[ *[0-9]*%\] //' | sort | uniq
tail -3 "$OUT/pytest_v.txt"
} 2>&1 | tee "$OUT/log.txt"
