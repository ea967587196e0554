#!/usr/bin/env bash
# Regenerate the detection table in README.md: 600 labelled traces (compute, comm and
# healthy in turn, 2000 iterations each, seed 2026), scored for all four methods.
set -euo pipefail
out=${1:-traces-2026.jsonl}
falconext gen-traces --count 600 --seed 2026 > "$out"
falconext eval-detect "$out"
