#!/usr/bin/env bash
# The training recipe on a lent GPU machine (models/smollm2-135m-dspark/MODEL_CARD.md, "Training on a GPU").
# Made here first: python -m dspark.training.device_bundle (the pieces under .device/, ignored by git).
#   check          on the device, one call per GGUF piece (carry .device/gguf-N): lists what has arrived
#   run            on the device (carry .device/prompts.jsonl .device/wheels .device/manifest.json): checks the
#                  pieces against the manifest, installs the wheels, rebuilds the target from the GGUF, runs
#                  configs/train-smollm2-gpu.yaml and leaves in $OUT the head (cut under 16 MiB per file), its
#                  summary and learning curve (small.tgz), the log, and the responses (gzip, cut likewise)
#   receive D DIR  here: joins what came back (the folder D) into the draft folder DIR and the responses file
# PY (default python3) runs Python; TRAIN_ARGS adds `dspark train` arguments (a dry run on a CPU: --set device=cpu).
set -uo pipefail
cd "$(dirname "$0")/.."
B=.device
say() { echo "[device $(date +%T)] $*"; }
case "${1:-run}" in
check)
    ls -la "$B" 2>&1
    nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader 2>&1
    "${PY:-python3}" -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__, torch.cuda.is_available())"
    df -h /tmp | tail -1
    exit 0 ;;
receive)
    from=${2:?receive FROM DIR}; into=${3:?receive FROM DIR}
    mkdir -p "$into"
    # the responses first: the dearest part to make again, and there even when training did not finish
    if ls "$from"/responses.jsonl.gz.part-* >/dev/null 2>&1; then
        cat "$from"/responses.jsonl.gz.part-* | gunzip > "$into/responses.jsonl" || exit 1
    fi
    [ -f "$from/small.tgz" ] && tar xzf "$from/small.tgz" -C "$into"
    if ls "$from"/model.safetensors.part-* >/dev/null 2>&1; then
        cat "$from"/model.safetensors.part-* > "$into/model.safetensors" || exit 1
    else
        echo "no head came back (training did not reach its export): see $from/train.log" >&2
    fi
    ls -la "$into"
    exit 0 ;;
run) ;;
*) echo "usage: $0 check|run|receive FROM DIR" >&2; exit 2 ;;
esac
OUT=${OUT:-/tmp/device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DSPARK_CACHE=${DSPARK_CACHE:-/tmp/dspark-cache}
say "checking the pieces"
"${PY:-python3}" - <<'PY' || exit 1
import hashlib, json, pathlib
b = pathlib.Path(".device")
m = json.loads((b / "manifest.json").read_text())
bad = [n for n, f in m["files"].items()
       if not (b / n).is_file() or hashlib.sha256((b / n).read_bytes()).hexdigest() != f["sha256"]]
if bad:
    raise SystemExit(f"missing or changed pieces: {bad}")
gguf = pathlib.Path("/tmp/gguf") / m["gguf_name"]
gguf.parent.mkdir(exist_ok=True)
with gguf.open("wb") as out:
    for piece in m["gguf_pieces"]:
        out.write((b / piece).read_bytes())
if hashlib.sha256(gguf.read_bytes()).hexdigest() != m["gguf_sha256"]:
    raise SystemExit("the joined GGUF does not match")
print(gguf)
PY
if ls "$B"/wheels/*.whl >/dev/null 2>&1; then
    "${PY:-python3}" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$B"/wheels/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD
export DSPARK_GGUF=$(ls /tmp/gguf/*.gguf)
say "rebuilding the target"
"${PY:-python3}" -m dspark.cli prepare || exit 1
say "training"
# shellcheck disable=SC2086
timeout "${TRAIN_SECONDS:-540}" "${PY:-python3}" -m dspark.cli train --config configs/train-smollm2-gpu.yaml ${TRAIN_ARGS:-} 2>&1 \
    | tr '\r' '\n' | grep -v "^train: " > "$OUT/train.log"
status=${PIPESTATUS[0]}
tail -40 "$OUT/train.log"
say "train exited with $status; collecting"
W=$DSPARK_CACHE/train/smollm2-gpu
rm -rf /tmp/device-small && mkdir -p /tmp/device-small
cp "$W"/draft/config.json "$W"/draft/training_summary.json /tmp/device-small/ 2>/dev/null
for curve in "$W"/*/curve.jsonl; do [ -f "$curve" ] && cp "$curve" "/tmp/device-small/curve-$(basename "$(dirname "$curve")").jsonl"; done
tar czf "$OUT/small.tgz" -C /tmp/device-small .
[ -f "$W/draft/model.safetensors" ] && split -b 15M "$W/draft/model.safetensors" "$OUT/model.safetensors.part-"
[ -f "$W/responses.jsonl" ] && gzip -c "$W/responses.jsonl" | split -b 15M - "$OUT/responses.jsonl.gz.part-"
ls -la "$OUT"
exit "$status"
