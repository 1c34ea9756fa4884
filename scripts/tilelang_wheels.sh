#!/usr/bin/env bash
# TileLang's wheels on the GPU machine, brought over two back-to-back runs (one carry holds
# 64 MiB; see fetch_tilelang_wheels.sh):
#   stash    run 1, carrying .tl_whl1/ only: copy it to ~/.xhal_tl_whl (kept while the machine is warm)
#   install  run 2, carrying .whl/ and .tl_whl2/: install the stash, .tl_whl2/ and apache-tvm-ffi
#            from .whl/ into /tmp/site (what gpu_run.sh puts on PYTHONPATH); a no-op once done
set -euo pipefail
cd "$(dirname "$0")/.."
stash=~/.xhal_tl_whl
case ${1:-} in
  stash)
    mkdir -p "$stash" && cp .tl_whl1/*.whl "$stash"/ && ls -l "$stash" ;;
  install)
    if [ -d /tmp/site/tilelang ]; then echo "tilelang already installed"; exit 0; fi
    if ! ls "$stash"/tilelang-*.whl >/dev/null 2>&1; then
      echo "no stashed tilelang wheel in $stash: run 'bash scripts/tilelang_wheels.sh stash' with .tl_whl1 carried first (the machine must still be warm)" >&2
      exit 1
    fi
    python3 -m pip install -q --no-index --no-deps --target /tmp/site "$stash"/*.whl .tl_whl2/*.whl .whl/apache_tvm_ffi-*.whl
    PYTHONPATH=/tmp/site python3 -c "import tilelang; print('tilelang', tilelang.__version__)" ;;
  *) echo "usage: $0 stash|install" >&2; exit 2 ;;
esac
