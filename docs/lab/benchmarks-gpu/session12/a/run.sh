#!/usr/bin/env bash
# Session 12 device batch A: where a batch-1 decode step goes. Kernels per step (CUDA graph
# dot dumps) and the build / issue / wait split, engine against mlx-lm, then the same split and
# the served B1 comparison under MLX's CUDA-graph settings (ops per graph, graphs off).
# Everything lands in $OUT/a.tar.gz; a step starts only if its limit fits the run's budget.
set -u
S=$(dirname "$(mktemp -u)")
export PYTHONPATH=$S/site:$S/site2:$PWD
D=$S/a; mkdir -p $D
T0=$(date +%s); BUDGET=${BUDGET:-560}
step() {  # tag, timeout, command...
  local tag=$1 lim=$2; shift 2; local t0=$(date +%s)
  if (( t0 - T0 + lim > BUDGET )); then echo "== $tag skipped (budget)" >&2; return; fi
  timeout $lim "$@" --out $D/$tag.json > /dev/null 2> $D/$tag.log
  echo "== $tag rc=$? $(( $(date +%s)-t0 ))s" >&2
  tar czf $OUT/a.tar.gz -C $S a
}
{ nvidia-smi; which nsys ncu nvcc; ls /usr/local/cuda*/bin 2>&1 | head -50; nproc; python3 -V; } > $D/tools.txt 2>&1
SG="python3 -m bench.step_graph --shaped-like .device/smol-shape"
step graph_b1 180 $SG --batch 1
step time_ops1000 70 env MLX_MAX_OPS_PER_BUFFER=1000 $SG --parts time
step time_nographs 70 env MLX_USE_CUDA_GRAPHS=0 $SG --parts time
step graph_b8 120 $SG --batch 8
SM="python3 -m bench.engine --shaped-like .device/smol-shape --prefill= --batches 1 --decode-prompt 128 --decode-tokens 128 --repeats 7 --warmup 1 --no-openblas-check"
step smol_nographs 100 env MLX_USE_CUDA_GRAPHS=0 $SM
step smol_default 100 $SM
