#!/usr/bin/env bash
# The served benchmark where the product runs (the accelerator machine, bfloat16): Orchard
# (`orchard serve --model M`, defaults) against mlx_lm.server (defaults: 32 decode rows, 8
# prompts in parallel) on the same random-weight model, as a user would compare them:
#  - one server at a time (both on one GPU would share its memory: Orchard sizes its KV pool
#    from what is free when it starts), each fresh (a new Ray, a new HOME: no learned rates);
#  - each warmed by 16 requests before it is measured (CUDA kernels JIT-compile on first use);
#  - every rate (and the warm-up) on its own --seed, so no prompt repeats within a server's life
#    (no prefix- or prompt-cache hit the user would not get); both servers get the same prompts;
#  - 64 output tokens with EOS ignored, counted from the streamed text.
# Between Orchard and the peer, the in-process engine at batch 1 (the one-stream yardstick).
#
#   SHAPES="smollm2-135m llama-3.1-8b" RATES="1:16 32:48" bench/device/serve_run.sh
#   VARIANTS='orchard= pad16={"merge_pad_tokens":16}' PEER=0 ... bench/device/serve_run.sh
#   VARIANTS='orchard= bucket64={"prefill_width_bucket":64}' PEER=0 ... bench/device/serve_run.sh
#     (prefill calls padded to multiples of 64 tokens, keys to whole pages: few prefill shapes)
# Each Orchard variant's replicas log their steps (ORCHARD_STEP_LOG, serve_app/step_log.py) to
# <shape>/<label>-steps.<pid>.jsonl.
#
# A SHAPES entry NAME=FOLDER serves that model folder (e.g. real weights imported on the device:
# bench/device/real_smollm2.sh) instead of building NAME's random-weight shape.
#
# RATES lists RATE:REQUESTS pairs (req/s : Poisson arrivals); prompts are 25-400 tokens. TOK is a
# folder with the tokenizer files the shaped models get (models/smollm2-135m is git-ignored: carry
# its tokenizer*.json, special_tokens_map.json and generation_config.json).
#
# Results land in $OUT as one .tar.gz per shape (the device returns at most 8 files). A step
# starts only if its time limit fits what is left of BUDGET seconds.
set -u
SHAPES=${SHAPES:-smollm2-135m}; RATES=${RATES:-1:16 32:48}; TOK=${TOK:-models/smollm2-135m}
# Orchard variants, each LABEL=ENGINE-KNOBS (a YAML/JSON mapping of EngineConfig knobs, e.g.
# 'pad16={"merge_pad_tokens":16}'); an empty mapping serves with `--model M` and no config.
VARIANTS=${VARIANTS:-orchard=}; PEER=${PEER:-1}   # PEER=0: no mlx_lm.server, no engine bench
# LLAMA_GGUF: also serve this GGUF (same weights) with llama.cpp's llama-server from LLAMA_BIN
# (bench/device/llama_cuda.sh build) after mlx_lm.server; applies to every shape in SHAPES.
LLAMA_GGUF=${LLAMA_GGUF:-}; LLAMA_BIN=${LLAMA_BIN:-/tmp/llama-cuda/bin}; LLAMA_SLOTS=${LLAMA_SLOTS:-64}
BUDGET=${BUDGET:-560}; ENGINE_LIMIT=${ENGINE_LIMIT:-90}; PY=${PY:-python3}
T0=$(date +%s); W=${W:-/tmp/serve-run}; mkdir -p $W
export RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
step() {  # tag, limit, command...
  local tag=$1 lim=$2; shift 2; local t0=$(date +%s)
  if (( lim > $(left) )); then echo "== $tag skipped (budget)" | tee -a $W/steps.txt >&2; return 1; fi
  timeout -k 10 $lim "$@" > $W/$tag.out 2> $W/$tag.log
  local rc=$?; echo "== $tag rc=$rc $(( $(date +%s) - t0 ))s" | tee -a $W/steps.txt >&2; return $rc
}
wait_http() {  # url, seconds
  $PY - "$1" "$2" <<'PYEOF'
import sys, time, urllib.request
url, deadline = sys.argv[1], time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    try:
        if urllib.request.urlopen(url, timeout=2).status == 200: sys.exit(0)
    except Exception: time.sleep(0.5)
sys.exit(1)
PYEOF
}
stop_group() {  # pid [ray dir]: SIGTERM its process group, SIGKILL what is left after 20 s
  kill -TERM -- -$1 2>/dev/null; for _ in $(seq 20); do kill -0 $1 2>/dev/null || break; sleep 1; done
  kill -KILL -- -$1 2>/dev/null
  # Ray's daemons leave the group; only this server's (their command lines name its RAY_TMPDIR)
  # are killed, never another Ray on the machine.
  [ -n "${2:-}" ] && pkill -KILL -f -- "$2" 2>/dev/null; sleep 2
}
load() {  # tag, url, model id, label, model folder: warm-up, then one run per rate on its own seed
  local tag=$1 url=$2 id=$3 label=$4 i=0 common
  common=(--target "label=$label,url=$url,model=$id" --scenario poisson --api completions
          --prompt-tokens 25-400 --max-tokens 64 --tokenizer $5 --extra-body '{"ignore_eos": true}'
          --no-plots)
  step $tag-warm 120 $PY -m loadtest bench-serve "${common[@]}" --rates 8 --requests-per-rate 16 \
    --seed 9000 --out $W/warm/$tag
  for spec in $RATES; do
    i=$((i + 1))
    # A rate step's limit: its arrivals' span three times over plus a minute for start-up and the
    # last streams, at most 150 s (a fixed 150 s made BUDGET skip fast servers' rates in run 7).
    lim=$(awk -v r=${spec%%:*} -v n=${spec##*:} 'BEGIN { l = 60 + 3 * n / r; print (l > 150 ? 150 : int(l)) }')
    step $tag-r${spec%%:*} $lim $PY -m loadtest bench-serve "${common[@]}" --rates ${spec%%:*} \
      --requests-per-rate ${spec##*:} --seed $((100 + i)) --out $W/$S/$label
  done
}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; $PY -V
  $PY -c 'import mlx.core as mx, mlx_lm, ray; print("mlx", mx.__version__, "mlx_lm", mlx_lm.__version__, "ray", ray.__version__)'
} > $W/versions.txt 2>&1
missing=$(for S in $SHAPES; do [[ $S == *=* ]] || [ -f $W/models/$S-random/config.json ] || echo $S; done)
[ -z "$missing" ] || step shapes 240 $PY -m bench.device.shaped_models --tokenizer-from $TOK --out $W/models $missing
for S in $SHAPES; do
  if [[ $S == *=* ]]; then m=${S#*=}; S=${S%%=*}; else m=$W/models/$S-random; fi
  id=$(basename $m); mkdir -p $W/$S
  port=8100
  for variant in $VARIANTS; do
    label=${variant%%=*}; knobs=${variant#*=}
    # A port of its own: the last server's socket may linger after it stopped.
    port=$((port + 1))
    args=(--model $m)
    if [ -n "$knobs" ]; then   # engine knobs (EngineConfig) through a config file
      printf 'http: {host: 127.0.0.1, port: %s}\nmodels:\n  - id: %s\n    path: %s\n    engine: %s\n' \
        $port $id $m "$knobs" > $W/$S/$label.yaml
      args=($W/$S/$label.yaml)
    fi
    home=$(mktemp -d /tmp/orc-XXXX)   # short: Ray's socket paths live under it
    HOME=$home RAY_TMPDIR=$home ORCHARD_STEP_LOG=$W/$S/$label-steps setsid $PY -m serve_app.cli \
      serve "${args[@]}" --host 127.0.0.1 --port $port > $W/$S/${label}_serve.log 2>&1 &
    pid=$!
    if wait_http http://127.0.0.1:$port/health 240; then
      load $S-$label http://127.0.0.1:$port $id $label $m
    else echo "== $S $label not healthy" | tee -a $W/steps.txt >&2; fi
    # Serve's own logs (a replica that failed to start says why only there).
    mkdir -p $W/$S/$label-ray-logs
    cp -r $home/ray/session_latest/logs/serve $W/$S/$label-ray-logs/ 2>/dev/null
    for f in $home/ray/session_latest/logs/worker-*.err; do
      [ -s "$f" ] && tail -50 "$f" > $W/$S/$label-ray-logs/$(basename $f); done 2>/dev/null
    stop_group $pid $home
  done
  nvidia-smi --query-gpu=memory.used --format=csv,noheader > $W/$S/gpu_mem_after_orchard.txt
  if [ "$PEER" = 1 ]; then
    # The in-process engine right after Orchard's runs (the one-stream yardstick is a ratio of
    # the two, and this host's speed drifts over minutes), then the peer. Five runs: quote
    # their median (`samples`), not the best (run 8's SmolLM2 shape: 316 tok/s once, 214-217
    # the other times).
    step $S-engine $ENGINE_LIMIT $PY -m bench.engine --model $m --prefill 512 --batches 1 \
      --decode-tokens 64 --repeats 5
    setsid $PY -m mlx_lm server --model $m --host 127.0.0.1 --port 8200 --log-level WARNING \
      > $W/$S/mlx_lm_server.log 2>&1 &
    pid=$!
    if wait_http http://127.0.0.1:8200/v1/models 120; then
      load $S-mlx_lm http://127.0.0.1:8200 $m mlx_lm.server $m
    else echo "== $S mlx_lm.server not healthy" | tee -a $W/steps.txt >&2; fi
    stop_group $pid
  fi
  if [ -n "$LLAMA_GGUF" ]; then
    # llama.cpp's CUDA server on a GGUF of the same weights (bench/device/llama_cuda.sh), all
    # layers on the GPU, continuous batching over LLAMA_SLOTS slots of 768 tokens (the longest
    # prompt, 64 tokens out and the template).
    setsid $LLAMA_BIN/llama-server -m $LLAMA_GGUF --host 127.0.0.1 --port 8300 --alias $id \
      -np $LLAMA_SLOTS -c $((LLAMA_SLOTS * 768)) --cont-batching -ngl 999 --no-webui \
      > $W/$S/llama_server.log 2>&1 &
    pid=$!
    { $LLAMA_BIN/llama-server --version; echo "gguf $(basename $LLAMA_GGUF) slots $LLAMA_SLOTS"; } \
      > $W/$S/llama_version.txt 2>&1
    if wait_http http://127.0.0.1:8300/health 120; then
      load $S-llama http://127.0.0.1:8300 $id llama.cpp $m
    else echo "== $S llama-server not healthy" | tee -a $W/steps.txt >&2; fi
    stop_group $pid
  fi
  cp $W/$S-* $W/versions.txt $W/steps.txt $W/$S/ 2>/dev/null
  tar czf $OUT/$S.tar.gz -C $W $S
done
cp $W/steps.txt $W/versions.txt $W/shapes.log $OUT/ 2>/dev/null
