#!/usr/bin/env bash
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
step() { echo; echo "=== $(date +%T) $*"; }
{
step "pytest (auto device = cuda)"
timeout 240 python3 -m pytest -q -n 8 -p no:cacheprovider --timeout 200 -rfE --tb=short -W ignore::DeprecationWarning > $OUT/pytest.txt 2>&1
tail -45 $OUT/pytest.txt
step "train: README recipe on a 5000-review slice, 1-minute budget, cuda, precision auto"
timeout 150 python3 -m classify.train --data .gpu/imdb --counterfactual .gpu/cf --limit 5000 --time-budget 1 \
  --output /tmp/r 2>&1 | grep -v "^step\|^\s*$" | tail -30
cp /tmp/r/test_metrics.json $OUT/ 2>/dev/null; tail -2 /tmp/r/metrics.jsonl
step "predict --json on cuda and on cpu, same run"
S=("It was not boring at all." "The acting was not superb." "The movie was terrible." "The film was wonderful.")
python3 -m classify.predict --model /tmp/r --device cuda --json "${S[@]}"
python3 -m classify.predict --model /tmp/r --device cpu --precision fp32 --json "${S[@]}"
step done
} 2>&1 | tee $OUT/log.txt
