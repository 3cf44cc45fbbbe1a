#!/usr/bin/env bash
# The wheels a GPU machine that reaches no package registry needs for scripts/gpu_check.sh.
#
#   bash scripts/gpu_wheels.sh fetch [--dry-run] [DIR]   # here (a registry in reach): download into DIR (default .whl)
#   bash scripts/gpu_wheels.sh install TARGET [DIR]      # there: install DIR's wheels into TARGET, offline
#
# fetch: the wheels for CPython 3.12 on x86-64 Linux (manylinux) of what such a machine's image lacks:
# megatron-core==0.19.2 (the release install.sh pins; it needs only torch, numpy and packaging, which a
# PyTorch image has), without dependencies. The package itself needs no wheel: gpu_check.sh puts the
# repository on PYTHONPATH. transformer-engine is not fetched (its CUDA wheels are far over what a
# copied working tree may carry); the checks that need it say skipped with the reason.
# install: `pip install --no-index --no-deps --target TARGET DIR/*.whl`, then prints TARGET (the
# PYTHONPATH entry to add); exit 1 with pip's last line when it fails, 3 when DIR holds no wheel.
# PYTHON (default python3) runs pip in both.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
WHEELS=("megatron-core==0.19.2")
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64)
usage() { sed -n '2,15p' "$0"; }
case "${1:-}" in
  fetch)
    shift
    dry=0
    if [ "${1:-}" = "--dry-run" ]; then dry=1; shift; fi
    dir="${1:-.whl}"
    plat=()
    for p in "${PLATFORMS[@]}"; do plat+=(--platform "$p"); done
    cmd=("$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" -d "$dir" "${WHEELS[@]}")
    if [ "$dry" = 1 ]; then echo "${cmd[*]}"; exit 0; fi
    mkdir -p "$dir" && "${cmd[@]}" || exit 1
    ls "$dir"/*.whl
    ;;
  install)
    target="${2:-}"
    dir="${3:-.whl}"
    [ -n "$target" ] || { echo "gpu_wheels: install needs a TARGET folder" >&2; exit 2; }
    shopt -s nullglob
    whls=("$dir"/*.whl)
    [ "${#whls[@]}" -gt 0 ] || { echo "gpu_wheels: no wheel in $dir (run 'bash scripts/gpu_wheels.sh fetch' where a registry is in reach)" >&2; exit 3; }
    log="$(mktemp)"
    if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" "${whls[@]}" >"$log" 2>&1; then
      echo "gpu_wheels: pip install into $target failed: $(tail -n 1 "$log")" >&2
      rm -f "$log"
      exit 1
    fi
    rm -f "$log"
    echo "$target"
    ;;
  -h | --help) usage ;;
  *) usage >&2; exit 2 ;;
esac
