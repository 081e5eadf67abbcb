#!/usr/bin/env bash
# Install Debian's Chromium for the browser UI test (tests/test_ui_browser.py) when it is missing.
# Needs root (or passwordless sudo) and the Debian package mirror; bounded by the caller's timeout.
# Exit 0: /usr/bin/chromium is there. Exit 2: cannot install here (message on stderr).
set -euo pipefail
CHROMIUM=/usr/bin/chromium
if [ -x "$CHROMIUM" ] && "$CHROMIUM" --version >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "no apt-get on this machine: cannot install chromium" >&2; exit 2
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo -n"
  else echo "not root and no passwordless sudo: cannot install chromium" >&2; exit 2; fi
fi
export DEBIAN_FRONTEND=noninteractive
LOCK=(-o DPkg::Lock::Timeout=120)
echo "installing chromium from Debian's packages (apt-get update + install)..." >&2
if ! $SUDO apt-get "${LOCK[@]}" update -qq >&2; then
  echo "apt-get update failed" >&2; exit 2
fi
if ! $SUDO apt-get "${LOCK[@]}" install -y -qq --no-install-recommends chromium >&2; then
  echo "apt-get install chromium failed" >&2; exit 2
fi
"$CHROMIUM" --version >&2 || { echo "chromium installed but does not run" >&2; exit 2; }
