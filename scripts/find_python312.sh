#!/usr/bin/env bash
# Prints the path of a Python 3.12 interpreter (JAX 0.11.2 needs 3.12), or fails with a clear message.
set -u
for cand in "${PYTHON312:-}" python3.12 /root/.pyenv/versions/3.12.1/bin/python3 \
            "$HOME/.pyenv/versions/3.12.1/bin/python3" /usr/bin/python3.12 /usr/local/bin/python3.12 python3; do
  [ -n "$cand" ] || continue
  path=$(command -v "$cand" 2>/dev/null) || continue
  if "$path" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 12) else 1)' 2>/dev/null; then
    echo "$path"; exit 0
  fi
done
if command -v pyenv >/dev/null 2>&1; then
  for v in $(pyenv versions --bare 2>/dev/null | grep '^3\.12'); do
    path="$(pyenv root)/versions/$v/bin/python3"
    [ -x "$path" ] && { echo "$path"; exit 0; }
  done
fi
echo "error: hybridlm needs Python 3.12 (JAX 0.11.2 supports no other here) and none was found;" \
     "install it (e.g. 'pyenv install 3.12') or set PYTHON312=/path/to/python3.12" >&2
exit 1
