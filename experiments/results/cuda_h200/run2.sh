#!/usr/bin/env bash
# The pytest suite alone on the GPU machine, each test named as it ends (the first call's quiet run was cut off).
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
python3 -m pytest -q --collect-only -p no:cacheprovider 2>/dev/null | grep "::" > $OUT/collected.txt; wc -l < $OUT/collected.txt
timeout 290 python3 -m pytest -v -n 12 -p no:cacheprovider -p no:benchmark --timeout 100 -rfE --tb=short \
  -W ignore::DeprecationWarning > $OUT/pytest_v.txt 2>&1
echo "pytest rc=$?"
grep -E "(PASSED|FAILED|ERROR|SKIPPED)" $OUT/pytest_v.txt | grep -c PASSED
grep -E "^\[gw.*(FAILED|ERROR)|^(FAILED|ERROR) " $OUT/pytest_v.txt | tail -30
tail -5 $OUT/pytest_v.txt
