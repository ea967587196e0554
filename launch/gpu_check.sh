#!/usr/bin/env bash
# The GPU check: falconext inside real Megatron-LM pretrain_gpt.py on one CUDA device (NCCL,
# a small GPT, a 2x slowdown injected on the GPU), about two minutes; prints one table and
# writes it under $OUT when set. Without a CUDA device it checks its prerequisites, prints one
# line saying "no GPU" and exits 0. Megatron-LM: MEGATRON_LM_PATH (a tree), else
# MEGATRON_LM_ARCHIVE (its release tarball), else the installed megatron-core's release in
# ../shared/megatron-lm, extracted to a scratch folder. --cpu-rehearsal runs the same job on CPU
# (emulated device).
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" launch/gpu_check.py "$@"
