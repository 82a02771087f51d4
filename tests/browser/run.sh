#!/usr/bin/env bash
# `make test-browser`: the report rendered in a real browser. Debian's Chromium (installed
# here when it is missing and this runs as root with apt-get; apt's cache is outside the
# clone) driven by Playwright (the `browser` dependency group). Where Chromium cannot be
# had, say so and skip, as the other heavy stages do.
set -euo pipefail
cd "$(dirname "$0")/../.."
UV="${UV:-uv}"
chromium="$(command -v chromium || true)"
if [ -z "$chromium" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "test-browser: installing Debian's chromium (once per machine)"
    log="$(mktemp)"
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; } >"$log" 2>&1; then
        tail -n 5 "$log"
    fi
    rm -f "$log"
    chromium="$(command -v chromium || true)"
fi
if [ -z "$chromium" ]; then
    echo "test-browser: skipped: no Chromium here and none could be installed (needs root and apt-get)"
    exit 0
fi
$UV sync --frozen --inexact --python python3 --quiet --compile-bytecode --group browser
ORCH_BROWSER="$chromium" $UV run --frozen --python python3 --group browser pytest -q tests/browser "$@"
