#!/usr/bin/env bash
# The GPU proof, in two steps that each fit a few minutes on one GPU machine:
#
#   bench/gpu.sh tests RESULTS_DIR              # the whole test suite, GPU tests included
#   bench/gpu.sh bench RESULTS_DIR [CKPT_DIR]   # an ~8 GB checkpoint in 8 shards, then the CUDA
#                                               # benchmark, cold and warm, with the ceilings
#   bench/gpu.sh tune RESULTS_DIR [CKPT_DIR]    # start-up costs step by step, and the sweep of
#                                               # threads x request size x ring against the defaults
#   bench/gpu.sh first-token RESULTS_DIR        # cold start to first token of a Llama checkpoint:
#                                               # transformers, streamload, compiled after / during load
#   bench/gpu.sh offload RESULTS_DIR            # a Llama 3x its budget: offload vs accelerate's CPU
#                                               # offload vs the whole model, tokens per second
#   bench/gpu.sh vllm RESULTS_DIR               # vLLM's load formats (needs vLLM's CUDA build): weights
#                                               # loaded, engine ready, first token; TP=2 with two GPUs
#
# Everything lands in RESULTS_DIR: device.txt, tests.log, bench.log, bench-gpu.{json,png,md},
# startup.log, sweep-warm.log, sweep-cold.log, first-token.{log,json}, offload.{log,json}, vllm*.{log,json}.
# DEVICE (default cuda), LAYERS (default 76: 8.1 GB) and RUNS (default 3) override the defaults.
set -uo pipefail
step=${1:?tests, bench, tune, first-token, offload or vllm}
out=${2:?a results directory}
ckpt=${3:-/tmp/streamload-gpu}
device=${DEVICE:-cuda}
python=${PYTHON:-python3}
mkdir -p "$out"
{
    date -u +%FT%TZ
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
    $python -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available())'
    $python -c 'import kvikio, kvikio.defaults as d; print("kvikio", kvikio.__version__, "compat", d.is_compat_mode_preferred())' 2>&1 | tail -1
} >"$out/device.txt"

case $step in
tests)
    PYTHONUNBUFFERED=1 $python -m pytest -q -rs tests 2>&1 | tee "$out/tests.log"
    ;;
bench | tune)
    if [ ! -f "$ckpt/model.safetensors.index.json" ]; then
        $python bench/make_checkpoint.py "$ckpt" --layers "${LAYERS:-76}" --shards 8 || exit
    fi
    du -sh "$ckpt" >>"$out/device.txt"
    ;;&
tune)
    PYTHONUNBUFFERED=1 $python bench/startup.py "$ckpt" --device "$device" --runs "${RUNS:-3}" 2>&1 | tee "$out/startup.log"
    PYTHONUNBUFFERED=1 streamload bench "$ckpt" --device "$device" --sweep 2>&1 | tee "$out/sweep-warm.log"
    PYTHONUNBUFFERED=1 streamload bench "$ckpt" --device "$device" --sweep --cold 2>&1 | tee "$out/sweep-cold.log"
    ;;
bench)
    PYTHONUNBUFFERED=1 streamload bench "$ckpt" --device "$device" --cold --warm --runs "${RUNS:-3}" \
        --json "$out/bench-gpu.json" --plot "$out/bench-gpu.png" --markdown "$out/bench-gpu.md" 2>&1 | tee "$out/bench.log"
    ;;
first-token)
    llama=/tmp/llama-first-token-gpu
    [ -f "$llama/config.json" ] || $python bench/first_token.py --make "$llama" --hidden 2048 --ffn 5632 --layers 24 || exit
    PYTHONUNBUFFERED=1 $python bench/first_token.py "$llama" --device "$device" --runs "${RUNS:-3}" \
        --json "$out/first-token.json" 2>&1 | tee "$out/first-token.log"
    ;;
offload)
    llama=/tmp/llama-offload-gpu
    [ -f "$llama/config.json" ] || $python bench/first_token.py --make "$llama" --hidden 2048 --ffn 5632 --layers 32 --vocab 32000 || exit
    PYTHONUNBUFFERED=1 $python bench/offload.py "$llama" --device "$device" --runs "${RUNS:-3}" \
        --json "$out/offload.json" 2>&1 | tee "$out/offload.log"
    ;;
vllm)
    llama=/tmp/llama-vllm-gpu
    [ -f "$llama/config.json" ] || $python bench/vllm.py --make "$llama" || exit
    PYTHONUNBUFFERED=1 $python bench/vllm.py "$llama" --dtype bfloat16 --runs "${RUNS:-3}" \
        --json "$out/vllm.json" 2>&1 | tee "$out/vllm.log"
    if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ]; then
        PYTHONUNBUFFERED=1 $python bench/vllm.py "$llama" --dtype bfloat16 --tp 2 --formats streamload,safetensors \
            --runs "${RUNS:-3}" --json "$out/vllm-tp2.json" 2>&1 | tee "$out/vllm-tp2.log"
    fi
    ;;
*)
    echo "usage: bench/gpu.sh tests|bench|tune|first-token|offload|vllm RESULTS_DIR [CKPT_DIR]" >&2
    exit 2
    ;;
esac
