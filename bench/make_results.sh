#!/usr/bin/env bash
# Assemble bench/RESULTS.md from the per-benchmark result files (each written by its benchmark
# together with the command that produced it).
set -euo pipefail
cd "$(dirname "$0")"
{
  echo "# Benchmark results"
  echo
  echo "Every table below was measured on this project's 2-core CPU machine and written by the"
  echo "benchmark named in it, with its exact command. The machine was shared with other jobs while"
  echo "most of them ran (load averages are given per table): treat times as indicative, ratios"
  echo "measured in one run on the same inputs as the comparison."
  echo
  for f in main_job gae losses distill rollout decode shared_prefix update trl trl_smollm2 async mismatch mismatch_seed1 mismatch_seed1_matched mismatch_bf16 learning; do
    if [ -f "results/$f.md" ]; then
      sed -e "s/^# /## /" -e "s#](\([A-Za-z0-9_.-]*\.png\))#](results/\1)#" "results/$f.md"
      echo
    fi
  done
} > RESULTS.md
echo "wrote bench/RESULTS.md"
