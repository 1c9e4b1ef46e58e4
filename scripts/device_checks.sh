#!/usr/bin/env bash
# The checks that need a CUDA device, as one command for a lent GPU machine whose python3 has
# torch, h5py, pandas, click, pytest and transformers (h5cmp itself runs from this checkout):
# the CUDA tests, scripts/bench_dump.py and the GPU variants of scripts/bench_localize.py.
# Each part has its own time limit and prints as it goes, so a part cut short still reports;
# a summary of every part comes last (the end of the output is what a lent machine returns).
# The whole log goes to $OUT/checks.log (or device-out/), the dumps of the localization cases
# that went wrong to $OUT/kept.tar.partNN (whole cases, 45 MB at most: what comes back is
# limited).
#
#     bash scripts/device_checks.sh [tests,dump,localize] [LOCALIZE STEPS, default 1] [SEEDS]
#
# Limits in seconds: H5CMP_TESTS_S (90), H5CMP_DUMP_S (180), H5CMP_LOCALIZE_S (180).
set -u
cd "$(dirname "$0")/.."
parts="${1:-tests,dump,localize}"
steps="${2:-1}"
seeds="${3:-1 2 3}"
out="${OUT:-device-out}"
mkdir -p "$out"
exec > >(tee -a "$out/checks.log") 2>&1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"
jobs=$(( $(nproc) > 3 ? $(nproc) - 2 : 1 ))

{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    "$py" -c "import torch, transformers, h5py, pandas, numpy; print('torch', torch.__version__,
'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'h5py', h5py.__version__,
'pandas', pandas.__version__, 'numpy', numpy.__version__)"
    nproc
} 2>&1

if [[ ",$parts," == *,tests,* ]]; then
    echo "== CUDA tests"
    timeout "${H5CMP_TESTS_S:-90}" "$py" -m pytest -q -m cuda -p no:cacheprovider \
        tests/test_fast_capture.py tests/test_sentinel.py tests/test_numerics.py \
        >/tmp/h5cmp-tests.log 2>&1
    tail -25 /tmp/h5cmp-tests.log
fi
if [[ ",$parts," == *,dump,* ]]; then
    echo "== bench_dump"
    timeout "${H5CMP_DUMP_S:-180}" "$py" scripts/bench_dump.py --device cuda --repeat 5 \
        --memory-steps 0 --paired-rounds 8 2>&1 | tee /tmp/h5cmp-dump.log
fi
if [[ ",$parts," == *,localize,* ]]; then
    # one seed at a time, so that the seeds done before the time limit are reported
    deadline=$(( SECONDS + ${H5CMP_LOCALIZE_S:-180} ))
    keep=$(mktemp -d)
    for seed in $seeds; do
        left=$(( deadline - SECONDS ))
        [ "$left" -gt 20 ] || break
        echo "== bench_localize seed $seed (gpu, tf32, gpu-bf16, gpu-fp16; steps $steps; $jobs jobs)"
        timeout "$left" "$py" scripts/bench_localize.py --variants gpu,tf32,gpu-bf16,gpu-fp16 \
            --steps "$steps" --seeds "$seed" --jobs "$jobs" --keep "$keep/kept" \
            >"/tmp/h5cmp-localize-$seed.log" 2>/tmp/h5cmp-localize.err
        echo "exit $?"
        cat "/tmp/h5cmp-localize-$seed.log"
        grep -v " done$" /tmp/h5cmp-localize.err | tail -5
    done
    if [ -d "$keep/kept" ]; then
        # each case compressed on its own; whole cases, smallest first, while 45 MB hold
        # them (a cut stream loses every case after the cut): cat kept.tar.part* | tar xf -
        # gives one CASE.tgz per case
        mkdir -p "$keep/packed"
        for case in "$keep"/kept/*/; do
            tar czf "$keep/packed/$(basename "$case").tgz" -C "$keep/kept" "$(basename "$case")"
        done
        total=0
        chosen=()
        while read -r size name; do
            [ $(( total + size )) -le $(( 45 * 1024 * 1024 )) ] || continue
            total=$(( total + size ))
            chosen+=("$name")
        done < <(cd "$keep/packed" && stat -c "%s %n" -- *.tgz | sort -n)
        echo "kept dumps: ${#chosen[@]} of $(ls "$keep/packed" | wc -l) cases ($total bytes)"
        if [ "${#chosen[@]}" -gt 0 ]; then
            tar cf - -C "$keep/packed" "${chosen[@]}" | split -b 15M -d - "$out/kept.tar.part"
            ls -l "$out"/kept.tar.part*
        fi
    fi
fi

echo "== summary"
[ -f /tmp/h5cmp-tests.log ] && echo "CUDA tests: $(tail -1 /tmp/h5cmp-tests.log)"
[ -f /tmp/h5cmp-dump.log ] && grep -E "GPU: |host sync" /tmp/h5cmp-dump.log
for log in /tmp/h5cmp-localize-*.log; do
    [ -f "$log" ] && echo "$log" && grep -E "^(held-out|tuning):|two-dump [0-9]+/" "$log"
done
true
