#!/usr/bin/env bash
# One prepared run on a CUDA machine (the session's `device` tool, or any box with one GPU):
# the GPU tests, `bench moe-layer` and `bench decode` on the GPU, a decode profile, grouped against
# per-sequence prefill, and a one-GPU `bench serve`
# against `python -m launch serve`. Every step runs even if an earlier one failed; each prints
# its exit status and time. Output: $OUT/all.log plus the benchmarks' JSON files.
#
#   OUT=/tmp/gpu-run bash tests/gpu/device_run.sh            # from the repository root
#
# Python packages the machine lacks (fastapi, uvicorn, pydantic, deepspeed, ...) can sit as wheels
# in .whl/: they are installed to /tmp/site first. Ray is not needed: one rank runs in-process.
# DEV=cpu runs the same steps on the CPU with small sizes (to check the script itself); PY picks the
# interpreter (default python3); SKIP="moe-layer prefill-ab ..." leaves those steps out; TOKENS, SHAPES
# and IMPLS override bench moe-layer's token counts, shapes and implementations; RATE is bench serve's
# --request-rate (default inf: every request at once).
set -u
OUT=${OUT:-/tmp/gpu-run}
DEV=${DEV:-cuda}
PY=${PY:-python3}
mkdir -p "$OUT"
LOG=$OUT/all.log
: >"$LOG"
export PYTHONUNBUFFERED=1 MASTER_ADDR=127.0.0.1 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 TOKENIZERS_PARALLELISM=false
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        >>"$LOG" 2>&1 && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
CKPT=${CKPT:-/tmp/gpu-run-ckpt}

say() { echo "$*" | tee -a "$LOG"; }
step() {  # step NAME SECONDS CMD...: run CMD with a time limit, its output to the log, its tail shown
    local name=$1 limit=$2 t0 rc
    shift 2
    case " ${SKIP:-} " in *" $name "*) say "=== $name: skipped"; return ;; esac
    say "=== $name: $*"
    t0=$(date +%s)
    timeout -k 10 "$limit" "$@" >"$OUT/step.log" 2>&1
    rc=$?
    cat "$OUT/step.log" >>"$LOG"
    tail -n "${TAIL:-12}" "$OUT/step.log"
    rm -f "$OUT/step.log"
    say "=== $name: rc $rc, $(($(date +%s) - t0)) s"
}

if [ "$DEV" = cuda ]; then
    TOKENS=${TOKENS:-"1 32 512 4096 16384"}; BATCHES="1 8 32 128"; PROMPTS=256; MIN_S=0.2; AB_PROMPTS=64; AB_ROUNDS=3
else
    TOKENS=${TOKENS:-"1 32"}; BATCHES="1 8"; PROMPTS=8; MIN_S=0; AB_PROMPTS=8; AB_ROUNDS=2
fi

step env 60 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv 2>&1;
  lscpu | grep -E 'Model name|^CPU\(s\)'; $PY -c 'import sys, torch, torch.nn.functional as F, transformers;
print(sys.version.split()[0], \"torch\", torch.__version__, \"transformers\", transformers.__version__);
print(\"cuda\", torch.cuda.is_available(), torch.version.cuda,
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else \"-\",
      torch.cuda.get_device_capability(0) if torch.cuda.is_available() else \"-\");
print(\"grouped_mm\", hasattr(F, \"grouped_mm\"), hasattr(torch, \"_grouped_mm\"))'
  $PY -c 'import deepspeed; print(\"deepspeed\", deepspeed.__version__)'"

step checkpoint 120 $PY -m launch make-tiny --arch deepseek_v3 --size small --out "$CKPT"

TAIL=30 step gpu-tests 300 $PY -m pytest -q -p no:cacheprovider tests/gpu tests/unit/test_sampler.py \
    tests/unit/test_experts_grouped.py -k "cuda or gpu or grouped or library"

if [ -z "${IMPLS:-}" ]; then
    IMPLS="ours ours-pytorch transformers transformers-grouped-mm dense-gemm"
    $PY -c "import deepspeed" >/dev/null 2>&1 && IMPLS="$IMPLS deepspeed"
fi
# shellcheck disable=SC2086
TAIL=100 step moe-layer 300 $PY -m launch bench moe-layer --device "$DEV" --dtype bfloat16 --tokens $TOKENS \
    --shapes ${SHAPES:-deepseek mixtral qwen3} --impls $IMPLS --min-seconds $MIN_S --json "$OUT/moe_layer.json"

# shellcheck disable=SC2086
TAIL=10 step decode 120 $PY -m launch bench decode --model "$CKPT" --batch-sizes $BATCHES --context-len 128 \
    --steps 20 --memory 16GiB --cuda-graphs --json "$OUT/decode.json"
# the same op by op, without CUDA graphs (the A/B of the step above)
# shellcheck disable=SC2086
TAIL=10 step decode-eager 120 $PY -m launch bench decode --model "$CKPT" --batch-sizes $BATCHES --context-len 128 \
    --steps 20 --warmup-steps 3 --memory 16GiB --json "$OUT/decode_eager.json"

TAIL=80 step profile 150 $PY tests/gpu/profile_decode.py --model "$CKPT" --batch-size 32 --steps 10 --context-len 128 \
    --memory 16GiB --top 25 --cuda-graphs

TAIL=12 step prefill-ab 150 $PY tests/gpu/prefill_groups_ab.py --model "$CKPT" --num-prompts $AB_PROMPTS \
    --rounds $AB_ROUNDS

serve_run() {  # serve_run NAME [server flags...]: a server, `bench serve` against it, its counters
    local name=$1
    shift
    case " ${SKIP:-} " in *" $name "*) say "=== $name: skipped"; return ;; esac
    say "=== $name: python -m launch serve --model $CKPT --port 8123 --memory 16GiB $*"
    $PY -m launch serve --model "$CKPT" --port 8123 --memory 16GiB --served-model-name tiny-small "$@" \
        >"$OUT/serve.log" 2>&1 &
    local server=$!
    for _ in $(seq 240); do
        curl -sf http://127.0.0.1:8123/v1/models >/dev/null 2>&1 && break
        kill -0 $server 2>/dev/null || break
        sleep 0.5
    done
    TAIL=40 step "bench-$name" 120 $PY -m launch bench serve --base-url http://127.0.0.1:8123 \
        --num-prompts $PROMPTS --random-input-len 256 --random-output-len 64 --random-range-ratio 0.5 \
        --request-rate "${RATE:-inf}" --seed 0 --tokenizer "$CKPT" --disable-tqdm --save-result --result-dir "$OUT" \
        --result-filename "$name.json"
    curl -s http://127.0.0.1:8123/metrics 2>/dev/null \
        | grep -E "^vllm:(generation_tokens|prompt_tokens|request_success)_total" | tee -a "$LOG"
    kill -INT $server 2>/dev/null
    wait $server
    say "=== $name: server exit $?"
    cat "$OUT/serve.log" >>"$LOG"
    rm -f "$OUT/serve.log"
}

serve_run serve --cuda-graphs
serve_run serve-eager
say "=== done"
