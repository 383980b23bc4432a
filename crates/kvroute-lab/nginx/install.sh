#!/bin/sh
# Installs Debian's nginx for `kvroute-lab bench proxy`, which compares the router's
# proxy hop with nginx as a plain reverse proxy. Only the binary is used: the
# bench writes its own configuration and runs nginx under a temporary prefix.
# Not run by CI.
set -eu
if command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ]; then
    exit 0
fi
SUDO=
if [ "$(id -u)" -ne 0 ]; then
    SUDO=sudo
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get install -y --no-install-recommends nginx \
    || { $SUDO apt-get update && $SUDO apt-get install -y --no-install-recommends nginx; }
