# Shared by this lease's scripts (sourced on the device, from the project root): the staged
# site on PYTHONPATH, results under $OUT/$RUN, and `step TAG LIMIT CMD...`, which runs CMD with
# `--out $D/TAG.json` under a time limit only if that limit fits the run's budget (a killed
# step keeps what it wrote; the next run's steps still start).
set -u
export PYTHONPATH=/tmp/site:$PWD
D=$OUT/$RUN; mkdir -p "$D"
T0=$(date +%s); BUDGET=${BUDGET:-570}
step() {
  local tag=$1 lim=$2; shift 2; local t0; t0=$(date +%s)
  if (( t0 - T0 + lim > BUDGET )); then
    echo "== $tag skipped (budget)" | tee -a "$D/steps.txt" >&2; return
  fi
  timeout "$lim" "$@" --out "$D/$tag.json" > /dev/null 2> "$D/$tag.log"
  echo "== $tag rc=$? $(( $(date +%s) - t0 ))s" | tee -a "$D/steps.txt" >&2
}
