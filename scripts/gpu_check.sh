#!/usr/bin/env bash
# The GPU checks of megatron-hetero, one script for a machine with (at least) one CUDA GPU.
#
#   bash scripts/gpu_check.sh [--dry-run] [--no-install] [CHECK ...]
#   CHECK: te_train offload tflops preset calibrate   (default: all five, in that order)
#
# te_train  `train` (LLaVA-style, colocated, world 1 NCCL, --bf16, 3 iterations) with
#           --transformer-impl transformer_engine: losses finite, iteration 1 within 2% of the
#           local impl's (the local run is also the fallback the other checks use without TE)
# offload   tests/gpu/test_gpu_offload.py: the encoder offload frees the device bytes it reports
#           (torch.cuda.memory_allocated before/after), alone and in the colocated language phase
# tflops    the te_train run's --log-throughput: tflops_per_rank of its last iteration (> 0)
# preset    python -m megatron_hetero.profiling.gpu_preset: CLIP-L/14 and 7B-class decoder layers in
#           bf16 timed on this GPU, written as $OUT/h200_measured.json (a planner hardware preset)
# calibrate python -m megatron_hetero.bench.gpu_calibrate: the cost model calibrated from a traced
#           world-1 bf16 train run (the preset's measured h200_measured.json, else the published
#           h200_141gb), its per-layer and step predictions against a second run of other shapes
#           measured: $OUT/calibration.json
#
# Prints one line per check, `gpu_check: NAME: ok|FAIL|skipped: detail`, writes the summary to
# ${OUT:-.}/gpu_check.json and exits 1 if any check FAILed (0 otherwise; 2 for bad arguments).
# Without a CUDA GPU every check is `skipped: no CUDA`. --dry-run installs and runs nothing (on a GPU
# machine each line says what would run). Set-up: the Python is $GPU_CHECK_PYTHON, else
# .venv/bin/python, else python3, the first that imports torch and megatron.core; else python3 with
# the wheels of .whl/ installed offline (`scripts/gpu_wheels.sh fetch` fills it where a registry is in
# reach: megatron-core for a PyTorch image that reaches none; then nothing is pip-installed from a
# registry, as with --no-install); else `scripts/install.sh test` makes
# .venv (a GPU with no usable Python after that FAILs every check).
# Then the gpu extra's transformer-engine is tried (unless --no-install); where it cannot be
# installed the TE parts say skipped with the reason and the rest still run. The checks are estimated
# at about 4 minutes on one H200 once installed (not yet run on a GPU; each step has its own timeout,
# together at most about 25 minutes); installing torch and transformer-engine on a fresh machine
# comes on top.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO="$(pwd)"
OUT_DIR="${OUT:-.}"
ALL=(te_train offload tflops preset calibrate)
DRY=0
INSTALL=1
NO_INSTALL_WHY="--no-install"
WANT=()
for a in "$@"; do
  case "$a" in
    --dry-run) DRY=1 ;;
    --no-install) INSTALL=0 ;;
    -h | --help) sed -n '2,33p' "$0"; exit 0 ;;
    te_train | offload | tflops | preset | calibrate) WANT+=("$a") ;;
    *) echo "gpu_check: unknown argument '$a' (checks: ${ALL[*]}; flags: --dry-run --no-install)" >&2; exit 2 ;;
  esac
done
[ "${#WANT[@]}" -gt 0 ] || WANT=("${ALL[@]}")
mkdir -p "$OUT_DIR" || { echo "gpu_check: cannot make OUT=$OUT_DIR" >&2; exit 2; }
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

NAMES=()
declare -A STATUS DETAIL
report() { # NAME STATUS DETAIL
  NAMES+=("$1"); STATUS[$1]="$2"; DETAIL[$1]="$3"
  echo "gpu_check: $1: $2: $3"
}
jstr() { local s="${1//\\/\\\\}"; s="${s//\"/\\\"}"; s="${s//$'\n'/ }"; printf '"%s"' "${s//$'\t'/ }"; }
write_json() {
  local f="$OUT_DIR/gpu_check.json" n sep=""
  {
    printf '{"checks": {'
    for n in "${NAMES[@]}"; do
      printf '%s%s: {"status": %s, "detail": %s}' "$sep" "$(jstr "$n")" "$(jstr "${STATUS[$n]}")" "$(jstr "${DETAIL[$n]}")"
      sep=", "
    done
    printf '}, "failed": %s, "dry_run": %s}\n' "$FAILED" "$([ "$DRY" = 1 ] && echo true || echo false)"
  } >"$f"
}
finish() {
  FAILED=0
  for n in "${NAMES[@]}"; do [ "${STATUS[$n]}" = FAIL ] && FAILED=$((FAILED + 1)); done
  write_json
  echo "gpu_check: summary in $OUT_DIR/gpu_check.json ($FAILED failed)"
  [ "$FAILED" = 0 ]
  exit $?
}
skip_all() { local n; for n in "${WANT[@]}"; do report "$n" skipped "$1"; done; finish; }
fail_all() { local n; for n in "${WANT[@]}"; do report "$n" FAIL "$1"; done; finish; }
wants() { local n; for n in "${WANT[@]}"; do [ "$n" = "$1" ] && return 0; done; return 1; }

# --- a Python and a GPU --------------------------------------------------------------------------
# no NVIDIA driver (nvidia-smi, /proc/driver/nvidia): no CUDA, decided without starting Python
if ! command -v nvidia-smi >/dev/null 2>&1 && [ ! -e /proc/driver/nvidia ]; then
  skip_all "no CUDA (no NVIDIA driver: neither nvidia-smi nor /proc/driver/nvidia)"
fi
usable() { [ -n "$1" ] && "$1" -c 'import torch, megatron.core' >/dev/null 2>&1; }
PY="${GPU_CHECK_PYTHON:-}"
if [ -z "$PY" ] && usable "$REPO/.venv/bin/python"; then PY="$REPO/.venv/bin/python"; fi
if [ -z "$PY" ] && usable "$(command -v python3 || true)"; then PY="$(command -v python3)"; fi
# a machine that reaches no registry: the wheels carried in .whl/, installed offline beside python3's own
if [ -z "$PY" ] && [ "$DRY" = 0 ] && command -v python3 >/dev/null 2>&1 && ls "$REPO"/.whl/*.whl >/dev/null 2>&1; then
  if SITE="$(PYTHON=python3 bash scripts/gpu_wheels.sh install "$WORK/site" "$REPO/.whl" 2>"$WORK/wheels.log")"; then
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    # carried wheels mean no registry in reach: no pip install from one (it would wait out its timeout)
    usable "$(command -v python3)" && PY="$(command -v python3)" && INSTALL=0 && NO_INSTALL_WHY="offline: the wheels of .whl/"
  fi
fi
cuda_of() { "$1" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0; }
if [ -n "$PY" ]; then
  GPUS="$(cuda_of "$PY")"
elif nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  GPUS="$(nvidia-smi -L | grep -c '^GPU')"
else
  GPUS=0
fi
[ "$GPUS" -ge 1 ] 2>/dev/null || skip_all "no CUDA (no GPU visible to torch or nvidia-smi)"
if [ "$DRY" = 1 ]; then
  for n in "${WANT[@]}"; do report "$n" skipped "dry run ($GPUS GPU(s) present; would run: scripts/gpu_check.sh $n)"; done
  finish
fi
if [ -z "$PY" ]; then
  if [ "$INSTALL" = 1 ] && timeout 900 bash scripts/install.sh test >"$WORK/install.log" 2>&1 && usable .venv/bin/python; then
    PY="$REPO/.venv/bin/python"
  else
    # a GPU is there but nothing could run on it: not a pass
    fail_all "set-up: no Python with torch and megatron-core (scripts/install.sh test: $(tail -n 1 "$WORK/install.log" 2>/dev/null | cut -c1-300))"
  fi
  GPUS="$(cuda_of "$PY")"
  [ "$GPUS" -ge 1 ] || skip_all "no CUDA (torch in $PY sees no GPU)"
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
has_te() { "$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("transformer_engine") is None)'; }
TE_WHY=""
if ! has_te; then
  if [ "$INSTALL" = 1 ]; then
    timeout 420 "$PY" -m pip install -q "transformer-engine[pytorch]" >"$WORK/te.log" 2>&1 || true
  fi
  has_te || TE_WHY="transformer-engine not installed ($([ "$INSTALL" = 1 ] && echo "pip install transformer-engine[pytorch]: $(tail -n 1 "$WORK/te.log" | cut -c1-200)" || echo "$NO_INSTALL_WHY"))"
fi
if [ -z "$TE_WHY" ] && ! "$PY" -c 'import transformer_engine.pytorch' >"$WORK/te_import.log" 2>&1; then
  TE_WHY="import transformer_engine.pytorch fails: $(tail -n 1 "$WORK/te_import.log" | cut -c1-200)"
fi
IMPL=transformer_engine
[ -z "$TE_WHY" ] || IMPL=local

# --- the checks ----------------------------------------------------------------------------------
printf 'placement: colocated\nmodules:\n  vision: {}\n  language: {}\nedges: [vision -> language]\n' >"$WORK/world1.yaml"
# the model of te_train/tflops; GPU_CHECK_SIZES replaces the size flags (e.g. smaller, to try the script)
read -r -a SIZES <<<"${GPU_CHECK_SIZES:---num-layers 4 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 \
--encoder-num-layers 2 --encoder-hidden-size 1024 --encoder-num-attention-heads 16 --encoder-tokens 256}"
TRAIN=(-m megatron_hetero.cli train --hetero-layout "$WORK/world1.yaml"
  --bf16 --train-iters 3 --global-batch-size 8 --micro-batch-size 4 --log-interval 1 --log-throughput "${SIZES[@]}")
train() { # IMPL -> $WORK/IMPL.jsonl; returns the CLI's exit status
  timeout 200 "$PY" "${TRAIN[@]}" --transformer-impl "$1" --log-jsonl "$WORK/$1.jsonl" >"$WORK/$1.log" 2>&1
}
records() { # FILE EXPR: EXPR over the records list `r` (python), printed
  "$PY" -c 'import json, math, sys; r = [json.loads(l) for l in open(sys.argv[1])]; print(eval(sys.argv[2]))' "$1" "$2"
}
TRAINED=""
if wants te_train || wants tflops; then
  LOCAL_RC=skipped
  if wants te_train || [ -n "$TE_WHY" ]; then # the comparison, or the fallback for tflops
    train local
    LOCAL_RC=$?
    [ "$LOCAL_RC" != 0 ] || TRAINED=local
  fi
  if [ -z "$TE_WHY" ]; then
    if train transformer_engine; then TRAINED=transformer_engine; else TE_RC=$?; fi
  fi
fi
if wants te_train; then
  if [ -n "$TE_WHY" ]; then
    report te_train skipped "$TE_WHY"
  elif [ "$TRAINED" != transformer_engine ]; then
    report te_train FAIL "train --transformer-impl transformer_engine exit ${TE_RC:-?}: $(tail -n 3 "$WORK/transformer_engine.log" | tr '\n' ' ' | cut -c1-400)"
  else
    got="$(records "$WORK/transformer_engine.jsonl" '[x["loss"] for x in r]')"
    if ! records "$WORK/transformer_engine.jsonl" 'all(math.isfinite(x["loss"]) for x in r) and len(r) == 3' | grep -q True; then
      report te_train FAIL "losses not finite (or not 3 iterations): $got"
    elif [ "$LOCAL_RC" != 0 ] || [ ! -s "$WORK/local.jsonl" ]; then
      report te_train ok "losses $got (finite; the local run failed, no comparison)"
    else
      ref="$(records "$WORK/local.jsonl" 'r[0]["loss"]')"
      rel="$(records "$WORK/transformer_engine.jsonl" "abs(r[0]['loss'] - $ref) / abs($ref)")"
      if "$PY" -c "import sys; sys.exit(0 if $rel <= 0.02 else 1)"; then
        report te_train ok "losses $got; iteration 1 vs local $ref: rel diff $rel (<= 0.02, bf16)"
      else
        report te_train FAIL "iteration 1 loss differs from local $ref by rel $rel (> 0.02); losses $got"
      fi
    fi
  fi
fi
if wants offload; then
  timeout 300 "$PY" -m pytest -q -rs -p no:cacheprovider tests/gpu/test_gpu_offload.py >"$WORK/offload.log" 2>&1
  rc=$?
  last="$(tail -n 1 "$WORK/offload.log")"
  if [ "$rc" = 0 ] && [[ "$last" == *"2 passed"* ]] && [[ "$last" != *skipped* ]]; then
    report offload ok "$last"
  elif [ "$rc" = 0 ]; then
    report offload FAIL "the GPU tests did not run: $(grep -E 'SKIPPED|passed|skipped' "$WORK/offload.log" | tail -n 2 | tr '\n' ' ' | cut -c1-400)"
  else
    report offload FAIL "$(grep -E 'assert|Error|passed|failed' "$WORK/offload.log" | tail -n 3 | tr '\n' ' ' | cut -c1-400)"
  fi
fi
if wants tflops; then
  if [ -z "$TRAINED" ]; then
    report tflops FAIL "no train run finished (local: $(tail -n 2 "$WORK/local.log" | tr '\n' ' ' | cut -c1-300))"
  else
    t="$(records "$WORK/$TRAINED.jsonl" 'r[-1].get("tflops_per_rank")')"
    if "$PY" -c "import sys; t = $t; sys.exit(0 if t is not None and t > 0 else 1)" 2>/dev/null; then
      report tflops ok "$t TFLOP/s per rank (train --log-throughput, --transformer-impl $TRAINED, bf16, iteration 3)"
    else
      report tflops FAIL "tflops_per_rank of the last record is $t"
    fi
  fi
fi
if wants preset; then
  if timeout 300 "$PY" -m megatron_hetero.profiling.gpu_preset --out "$OUT_DIR/h200_measured.json" --impl "$IMPL" >"$WORK/preset.log" 2>&1; then
    report preset ok "$OUT_DIR/h200_measured.json ($IMPL): $(tail -n 1 "$WORK/preset.log" | cut -c1-400)"
  else
    report preset FAIL "$(tail -n 3 "$WORK/preset.log" | tr '\n' ' ' | cut -c1-400)"
  fi
fi
if wants calibrate; then
  HW=h200_141gb
  [ -s "$OUT_DIR/h200_measured.json" ] && HW="$OUT_DIR/h200_measured.json"
  if timeout 480 "$PY" -m megatron_hetero.bench.gpu_calibrate --out "$OUT_DIR/calibration.json" --hardware "$HW" \
    --bf16 --work "$WORK/calibrate" >"$WORK/calibrate.log" 2>&1; then
    report calibrate ok "$OUT_DIR/calibration.json ($HW): $(grep '^held-out' "$WORK/calibrate.log" | tr '\n' ' ' | cut -c1-600)"
  else
    report calibrate FAIL "$(tail -n 3 "$WORK/calibrate.log" | tr '\n' ' ' | cut -c1-400)"
  fi
fi
finish
