#!/usr/bin/env bash
# Create .venv (once) and install rlfunc with its test extras, pinned by constraints.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
if ! .venv/bin/python -c "import rlfunc, torchrl, pytest, stable_baselines3, scipy, rliable.library" 2>/dev/null; then
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q -c constraints.txt -e ".[dev,tb]"
fi
