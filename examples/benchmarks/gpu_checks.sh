#!/usr/bin/env bash
# The GPU checks in one run, each step time-limited and logged, a summary at the end.
#   bash examples/benchmarks/gpu_checks.sh ["env ns compile main kernels bench trainers"] [LOGDIR]
# env:     the machine, dmuon_fn's CUDA backend line (measures auto's triangle rule), which
#          kernel packages import.
# ns:      orthogonalize vs torch.optim.Muon with the kernels importable here (bench_gpu.py).
# compile: the compiled functional step on one GPU (NCCL, world 1), Z2 fp32 and Z3 bf16.
# main:    the main job (--quick) on one GPU.
# kernels: the CuTe DSL / quack triangle kernels against float64 references
#          (tests/test_gpu_syrk.py) and their ahead-of-time builds (tests/test_cute_aot.py).
# bench:   bench_gpu.py's SYRK and orthogonalize tables with errors.
# trainers: accelerate's FSDP2 plugin as it runs on GPUs (examples/accelerate_fsdp2.py: train,
#          save_state/load_state bit-exact, get_state_dict + save_pretrained logits).
# Needs a CUDA device; nvidia-cutlass-dsl (and quack-kernels) for kernels and bench.
set -u
phases=" ${1:-env ns compile main kernels bench trainers} "
logdir=${2:-gpu_logs}
mkdir -p "$logdir"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export DMUON_CACHE_DIR=${DMUON_CACHE_DIR:-$(mktemp -d)}
py=${PYTHON:-python3}
summary=()

step() {  # step NAME SECONDS CMD...: run, log to $logdir/NAME.log, record rc and seconds
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    echo "=== $name: $*"
    timeout "$limit" "$@" >"$logdir/$name.log" 2>&1
    local rc=$?
    tail -n 40 "$logdir/$name.log"
    summary+=("$name rc=$rc $((SECONDS - t0))s")
}

if [[ $phases == *" env "* ]]; then
    step env 90 bash -c "nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; $py -c '
import sys, torch, dmuon_fn
print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name())
print(dmuon_fn.get_ns_backend(torch.device(\"cuda\")))
for m in (\"cutlass\", \"quack\"):
    try:
        __import__(m); print(m, \"importable\")
    except Exception as e:
        print(m, \"not importable:\", type(e).__name__, e)
'"
fi
if [[ $phases == *" ns "* ]]; then
    step ns_base 70 $py examples/benchmarks/bench_gpu.py --part ns --sizes 1024 4096 8192 \
        --ratios 1 4 --check
fi
if [[ $phases == *" compile "* ]]; then
    step compile_z2 70 $py -m torch.distributed.run --nproc_per_node=1 \
        examples/compile_step.py --steps 30
    step compile_z3_bf16 130 $py -m torch.distributed.run --nproc_per_node=1 \
        examples/compile_step.py --steps 30 --z3 --bf16
fi
if [[ $phases == *" main "* ]]; then
    step main_job 80 $py -m torch.distributed.run --nproc_per_node=1 examples/train_gpt.py \
        --quick --out "$logdir/gpt"
fi
if [[ $phases == *" kernels "* ]]; then
    step kernel_tests 180 $py -m pytest -q -p no:cacheprovider tests/test_gpu_syrk.py \
        tests/test_cute_aot.py
fi
if [[ $phases == *" bench "* ]]; then
    step bench_gpu 120 $py examples/benchmarks/bench_gpu.py --sizes 1024 2048 4096 8192 \
        --ratios 1 4 --check
fi
if [[ $phases == *" trainers "* ]]; then
    step accelerate_fsdp2 150 $py -m torch.distributed.run --nproc_per_node=1 \
        examples/accelerate_fsdp2.py --out "$logdir/accelerate"
fi
echo "=== summary"
printf '%s\n' "${summary[@]}"
