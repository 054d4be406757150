#!/usr/bin/env bash
# Installs a headless Chromium for the HTML-report test (tests/test_dump_report.py) when
# none is on PATH, using Debian/Ubuntu packages. Never fails: without a browser that
# one test is skipped (and fails under CI=true, where a browser is required).
if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || command -v google-chrome >/dev/null 2>&1; then
  exit 0
fi
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = "0" ]; then
  echo "installing chromium (for the HTML report test)..."
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || echo "could not install chromium; the HTML report browser test will be skipped"
else
  echo "no chromium on PATH and no root apt-get; the HTML report browser test will be skipped"
fi
exit 0
