#!/bin/bash
# The library at REV (a temporary git worktree) and the working tree, one after the other on
# this machine: bench_ns, the main job and the overlap benchmark's quick mode (needs root).
#   examples/benchmarks/before_after.sh REV [OUT_DIR]
set -u
REV=${1:?usage: before_after.sh REV [OUT_DIR]}
HERE=$(git rev-parse --show-toplevel)
OUT=${2:-$(mktemp -d)}
BEFORE=$OUT/before
git -C "$HERE" worktree add -q --detach "$BEFORE" "$REV" || exit 1
trap 'git -C "$HERE" worktree remove --force "$BEFORE"' EXIT
# one dispatch cache for both trees: both run the same Newton-Schulz choices
export DMUON_CACHE_DIR=$OUT/cache TORCHINDUCTOR_CACHE_DIR=$OUT/inductor MPLCONFIGDIR=$OUT/mpl
lscpu | grep "Model name"
python -c "import torch; print(torch.__version__, torch.backends.cpu.get_cpu_capability())"
run() {  # tree name, then the command
    local tree=$1 name=$2; shift 2
    local dir=$HERE; [ "$tree" = before ] && dir=$BEFORE
    echo "=== $tree ($([ "$tree" = before ] && echo "$REV" || echo "working tree")): $name"
    (cd "$dir" && PYTHONPATH=$dir timeout 900 "$@") 2>&1
}
for t in before after; do run $t bench_ns python examples/benchmarks/bench_ns.py --reps 5 | tail -30; done
for t in before after; do
    run $t "main job" torchrun --nproc_per_node=4 examples/train_gpt.py --out "$OUT/gpt_$t" \
        | grep -E "^\| (Muon|AdamW) |advantage|reaches"
done
for t in before after; do  # what --quick sets, spelled out for trees that predate the flag
    run $t "overlap, quick" python examples/benchmarks/bench_overlap.py --rates 1gbit --steps 4 \
        --warmup 1 | grep -vE "socket.cpp"
done
