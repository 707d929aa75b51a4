#!/usr/bin/env bash
# Install deggs with its test extras into a fresh .venv-test, check style and types, and
# run the whole test suite (arguments go to pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .venv-test
python3 -m venv .venv-test
.venv-test/bin/python -m pip install --quiet --upgrade pip
.venv-test/bin/python -m pip install --quiet -e '.[test]'
.venv-test/bin/ruff check .
.venv-test/bin/ruff format --check .
.venv-test/bin/mypy
.venv-test/bin/python -m pytest "$@"
