#!/usr/bin/env bash
# A real Slurm cluster on the emulated nodes bed (root, Debian's slurm-wlm and munge):
#     bash launch/slurm_bed.sh up [--nodes 3] [--link-mbps 400]   # sinfo then shows the nodes idle
#     bash launch/slurm_bed.sh status
#     bash launch/slurm_bed.sh down
# What it runs and where: falconext/testbed/slurm_bed.py.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" -m falconext.testbed.slurm_bed "$@"
