#!/bin/sh
# The example end to end: data, a run killed after step 6's checkpoint, the resume with
# other weights. Usage: sh examples/llm_pretrain/run.sh [WORKDIR]
set -u
WORK=${1:-llm-example}
HERE=$(dirname "$0")
rm -rf "$WORK/ckpt" "$WORK/log.jsonl"
python "$HERE/prepare.py" "$WORK" || exit 1
torchrun --nproc-per-node 2 "$HERE/train.py" "$WORK" --steps 12 --kill-at 6 && { echo "the run was not killed"; exit 1; }
torchrun --nproc-per-node 2 "$HERE/train.py" "$WORK" --steps 12 --resume --weights 0.25,0.75 || exit 1
cat "$WORK/log.jsonl"
