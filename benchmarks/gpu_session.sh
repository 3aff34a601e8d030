#!/usr/bin/env bash
# The checks that need a CUDA GPU, prepared to run unattended on a borrowed machine.
#
#   bash benchmarks/gpu_session.sh tests   # CUDA unit tests: device, graph-safe model, sampler, CLI
#   bash benchmarks/gpu_session.sh bench   # cuda_traces.py on SmolLM2, generate on CUDA, bench
#
# Environment: OUT (results folder, default ./gpu-out), WHEELS (folder of wheels to install into
# /tmp/site first, for packages the machine lacks), MODEL (model name or path; default
# smollm2-135m, else a randomly initialised model with SmolLM2-135M's shapes is written with
# transformers, which times the same as the trained weights). Every step has its own time limit
# and writes its log under OUT, so a step that fails or runs long leaves the others' results.
set -u
stage=${1:?usage: gpu_session.sh tests|bench}
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}

step() {  # step NAME SECONDS COMMAND... : run with a limit, log to OUT/NAME.txt, report status
    local name=$1 limit=$2
    shift 2
    local clock=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.txt" 2>&1
    local rc=$?
    echo "== $name: exit $rc in $((SECONDS - clock)) s (limit $limit s)" | tee -a "$OUT/steps.txt"
    tail -n 25 "$OUT/$name.txt"
    return 0
}

if [ -n "${WHEELS:-}" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$WHEELS"/*.whl || exit 3
fi
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    $PY -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
    $PY -c "import transformers, transitions, gguf; print('transformers', transformers.__version__)"
} >"$OUT/environment.txt" 2>&1
cat "$OUT/environment.txt"

case $stage in
tests)
    step pytest_cuda 240 $PY -m pytest -q -p no:cacheprovider -o addopts="-ra" \
        tests/runtime/test_cuda_device.py tests/runtime/test_torch_device.py \
        tests/models/test_graph_safe.py tests/runtime/test_device_sampler.py \
        tests/integration/test_cli.py tests/models/test_executor_sleep_cuda.py
    ;;
bench)
    MODEL=${MODEL:-smollm2-135m}
    if [ "$MODEL" = random-smollm2 ]; then
        MODEL=/tmp/random-smollm2
        $PY - "$MODEL" <<'EOF'
import sys, torch, transformers
config = transformers.LlamaConfig(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
    rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
    bos_token_id=1, eos_token_id=2,
)
torch.manual_seed(0)
transformers.LlamaForCausalLM(config).save_pretrained(sys.argv[1])
print("wrote a random SmolLM2-135M-shaped model to", sys.argv[1])
EOF
    fi
    echo "model: $MODEL" | tee -a "$OUT/steps.txt"
    step cuda_traces 240 $PY benchmarks/cuda_traces.py --device cuda --model "$MODEL" \
        --out "$OUT/cuda_traces.json"
    for trace in none decode_only; do
        step "generate_$trace" 60 $PY -m models.cli generate --model "$MODEL" --device cuda \
            --trace "$trace" --chat --prompt "What is the capital of France?" \
            --prompt "Name three primary colours." --max-new-tokens 32 --json
    done
    step bench_cuda 150 $PY -m models.cli bench --model "$MODEL" --device cuda \
        --trace decode_only --batch-sizes 1,8,32 --prompt-len 128 --new-tokens 64 --json
    ;;
*)
    echo "unknown stage $stage: allowed are tests, bench" >&2
    exit 2
    ;;
esac
cat "$OUT/steps.txt"
