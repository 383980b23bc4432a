#!/usr/bin/env bash
# Runs each fuzz target of tests/fuzz.rs for N minutes (default 1), one after
# another, and prints how many inputs each tried. Not part of CI, which runs
# the same targets on a bounded number of cases.
#
#   tests/fuzz.sh [MINUTES] [TARGET_FILTER]
set -euo pipefail
cd "$(dirname "$0")/.."
minutes="${1:-1}"
filter="${2:-fuzz_}"
seconds=$(awk -v m="$minutes" 'BEGIN { printf "%d", m * 60 }')
KVROUTE_FUZZ_SECONDS="$seconds" cargo test --locked --test fuzz -- \
    --nocapture --test-threads 1 "$filter" 2>&1 | grep -E '^fuzz |^test |test result'
