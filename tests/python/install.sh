#!/usr/bin/env bash
# Installs the official OpenAI and Anthropic Python clients (PyPI `openai` and
# `anthropic`) that tests/apis.rs drives against `kvroute serve` in front of
# `kvroute sim`, into a virtualenv under target/ (never committed).
# Idempotent: a second run only checks the versions. Prints the venv's python.
set -euo pipefail
cd "$(dirname "$0")/../.."

openai="3.51.0"
anthropic="2.10.0"
venv="target/python/venv"
python="$venv/bin/python"

installed() {
    [ -x "$python" ] && "$python" - "$openai" "$anthropic" <<'PY' 2>/dev/null
import sys
import anthropic
import openai
sys.exit(0 if (openai.__version__, anthropic.__version__) == tuple(sys.argv[1:3]) else 1)
PY
}

if ! installed; then
    rm -rf "$venv"
    mkdir -p "$(dirname "$venv")"
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check \
        "openai==$openai" "anthropic==$anthropic"
    installed || { echo "openai $openai and anthropic $anthropic did not install into $venv" >&2; exit 1; }
fi
echo "$PWD/$python"
