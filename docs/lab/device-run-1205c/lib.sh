# Shared by this lease's scripts (sourced on the device, from the project root): the site
# bench/device/stage-mlx's install.sh staged in the temp folder on PYTHONPATH, random-weight
# model folders under $W, results under $OUT/$RUN, and `step TAG LIMIT CMD...`, which runs CMD with
# `--out $D/TAG.json` under a time limit only if that limit fits the run's budget (a killed
# step keeps what it wrote; the next run's steps still start). Every step's stderr goes to one
# log.txt (since device run 16: a run returns at most 8 files, and m3 lost a JSON to the count).
set -u
TMP=$(dirname "$(mktemp -u)")
export PYTHONPATH=$TMP/site:$PWD
W=$TMP/WM
D=$OUT/$RUN; mkdir -p "$D"
T0=$(date +%s); BUDGET=${BUDGET:-570}
step() {
  local tag=$1 lim=$2; shift 2; local t0; t0=$(date +%s)
  if (( t0 - T0 + lim > BUDGET )); then
    echo "== $tag skipped (budget)" | tee -a "$D/steps.txt" >&2; return
  fi
  echo "== $tag: $*" >> "$D/log.txt"
  timeout "$lim" "$@" --out "$D/$tag.json" > /dev/null 2>> "$D/log.txt"
  echo "== $tag rc=$? $(( $(date +%s) - t0 ))s" | tee -a "$D/steps.txt" >&2
}
