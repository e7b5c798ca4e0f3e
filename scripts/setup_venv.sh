#!/usr/bin/env bash
# Creates .venv with Python 3.12 and installs hybridlm with its test extras (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(scripts/find_python312.sh)
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  echo "creating $VENV with $PY"
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -e ".[test,plot,dev]"
"$VENV/bin/python" -m ipykernel install --user --name hybridlm >/dev/null 2>&1 || true
touch "$VENV/.installed"
