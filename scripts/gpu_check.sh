#!/usr/bin/env bash
# The device checks for a lent CUDA GPU (issues 16 and 18), as one prepared script. Run from the repo
# root on the GPU machine with the machine's own torch and our pins carried as wheels in .whl/
# (see bench/RESULTS.md "GPU"); every result goes to $OUT (default ./gpu_out).
#   compiled == eager under CUDA graphs and per-step times (bench.gpu_check), the compiled rollout
#   policy's us per call (bench.compiled_act), end-to-end env steps/s
#   of ppo (HalfCheetah-v5) and sac (Pendulum-v1) with --compile off / on, nccl with world size 1
#   under torchrun, --nproc 2 on one GPU, and a profiler trace.
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
if [ -d .whl ] && [ -z "${NO_WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor  # no MUJOCO_GL: nothing here renders (egl needs the loaders carried)
PY=${PY:-python3}
DEV=${DEV:-cuda}
HC_STEPS=${HC_STEPS:-40960}
SAC_STEPS=${SAC_STEPS:-5000}
R=/tmp/runs
rm -rf $R; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
$PY -c 'import torch, tensordict, torchrl; print(torch.__version__, tensordict.__version__, torchrl.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else "no cuda")' >> "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"

last() {  # name run_dir: the run's last metrics line's speed fields and its eval
  $PY - "$1" "$2" <<'EOF'
import json, sys
name, d = sys.argv[1], sys.argv[2]
try:
    lines = [json.loads(l) for l in open(f"{d}/metrics.jsonl")]
    steps = [l for l in lines if "steps_per_s" in l]
    keep = ("steps_per_s", "collect_s", "update_s", "env_wait_s", "allreduce_s", "compile_s", "step", "iteration")
    print(json.dumps({"run": name, "first": {k: steps[0].get(k) for k in keep if k in steps[0]},
                      "last": {k: steps[-1].get(k) for k in keep if k in steps[-1]},
                      "median_steps_per_s_after_first": sorted(l["steps_per_s"] for l in steps[1:])[len(steps[1:]) // 2] if len(steps) > 1 else None,
                      "compile_s": next((l["compile_s"] for l in lines if "compile_s" in l), None),
                      "wall_s": lines[-1].get("time")}))
except Exception as e:
    print(json.dumps({"run": name, "error": repr(e)}))
EOF
}

# B, in the background (not timing claims): nccl at world size 1, --nproc 2 on one GPU, the profiler
(
  export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_bg  # concurrent compiles into one inductor cache race ("file too short")
  timeout 150 $PY -m torch.distributed.run --standalone --nproc-per-node 1 -m rlfunc train ppo --env Pendulum-v1 --device $DEV \
    --total-steps 8192 --eval-episodes 5 --run-dir $R/nccl1 > "$OUT/nccl1.log" 2>&1; echo "rc=$?" >> "$OUT/nccl1.log"
  last nccl1 $R/nccl1 >> "$OUT/results.jsonl"
  timeout 90 $PY -m rlfunc train ppo --env Pendulum-v1 --device $DEV --nproc 2 --total-steps 8192 --eval-episodes 5 \
    --run-dir $R/nccl2 > "$OUT/nccl2.log" 2>&1; echo "rc=$?" >> "$OUT/nccl2.log"
  timeout 150 $PY -m rlfunc train ppo --env HalfCheetah-v5 --device $DEV --compile ${PROF_COMPILE:-on} --profile 2 --total-steps 16384 \
    --eval-episodes 1 --run-dir $R/prof > "$OUT/prof.log" 2>&1; echo "rc=$?" >> "$OUT/prof.log"
  $PY - $R/prof "$OUT" <<'EOF' >> "$OUT/prof.log" 2>&1
import glob, gzip, json, os, shutil, sys
from collections import defaultdict
d, out = sys.argv[1], sys.argv[2]
traces = sorted(glob.glob(f"{d}/profile/*.json*"))
print("traces:", traces)
for t in traces[:1]:
    opener = gzip.open if t.endswith(".gz") else open
    ev = json.load(opener(t))["traceEvents"]
    span = defaultdict(float); kern = defaultdict(float)
    for e in ev:
        if e.get("ph") != "X": continue
        if e.get("cat") == "user_annotation": span[e["name"]] += e["dur"] / 1e3
        if e.get("cat") == "kernel": kern[e["name"][:60]] += e["dur"] / 1e3
    print(json.dumps({"ranges_ms": dict(sorted(span.items(), key=lambda x: -x[1])[:15]),
                      "gpu_kernel_ms_total": sum(kern.values()), "top_kernels_ms": dict(sorted(kern.items(), key=lambda x: -x[1])[:8])}))
    with open(t, "rb") as f, gzip.open(f"{out}/trace.json.gz", "wb") as g:
        shutil.copyfileobj(f, g)
EOF
  # fp16 on the device: the loss scale is learner state, so 200 bc updates + resume to 400 == 400 in one go
  timeout 120 $PY - $R $DEV <<'EOF' > "$OUT/fp16_resume.log" 2>&1
import sys, torch
import rlfunc.run.diffusion as td
from rlfunc.algos.bc import BCConfig
from rlfunc.algos.diffusion_actor import ActorSpec
from rlfunc.config import replace
from rlfunc import resume, train
r, dev = sys.argv[1], sys.argv[2]
cfg = lambda n: replace(BCConfig(), actor=ActorSpec(hidden=(256, 256)), num_demos=32, num_updates=n, batch_size=256, log_every=50,
                        checkpoint_every=0, eval_episodes=4, device=dev, precision="fp16")
whole = train(cfg(400), f"{r}/fp16_whole", progress=False, tensorboard=False)
train(cfg(200), f"{r}/fp16_split", progress=False, tensorboard=False)
resumed = resume(f"{r}/fp16_split", 400, progress=False, tensorboard=False)
same = all(torch.equal(whole.state[k], resumed.state[k]) for k in whole.state.keys(True, True))
print({"fp16_resume_exact": same, "scale": float(whole.state["optim_actor", "scale"]),
       "growth_tracker": int(whole.state["optim_actor", "growth_tracker"])})
EOF
  # the eager diffusion actor-critics on the device, a few updates each (a host tensor beside device ones fails only here)
  for algo in sac-diffusion td3-diffusion; do
    timeout 120 $PY -m rlfunc train $algo --env PointReach-v0 --device $DEV --compile off --total-steps 3840 --warmup-steps 1920 \
      --updates-per-iteration 8 --eval-episodes 4 --run-dir $R/$algo > "$OUT/$algo.log" 2>&1; echo "rc=$?" >> "$OUT/$algo.log"
  done
) &
BG=$!
# C, in the background on the host's idle cores: DPPO's compiled step on the CPU (issue 18's CPU target)
[ -z "${SKIP_CPU:-}" ] && ( OMP_NUM_THREADS=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cpu timeout 420 $PY -m bench.compiled_dppo --repeats 3 \
    > "$OUT/compiled_dppo_cpu.txt" 2>&1; lscpu | grep -i "model name" >> "$OUT/compiled_dppo_cpu.txt" ) &
CPUJOB=${SKIP_CPU:+}$!

# A, in the foreground (the timing claims)
timeout 300 $PY -m bench.gpu_check --device $DEV --repeats 5 ${CASES:+--cases $CASES} 2>&1 | grep -v "INFO" | tee "$OUT/gpu_check.jsonl"
# the rollout policy's forward compiled (CUDA graphs) vs eager, us per call (device.POLICY_COMPILE_DEVICES)
timeout 150 $PY -m bench.compiled_act --device $DEV --repeats 5 2>&1 | grep -v "INFO" | tee "$OUT/compiled_act.txt"
for mode in off on; do
  timeout 120 $PY -m rlfunc train ppo --env HalfCheetah-v5 --device $DEV --compile $mode --total-steps $HC_STEPS --eval-episodes 1 \
    --run-dir $R/hc_$mode > "$OUT/hc_$mode.log" 2>&1
  last ppo_halfcheetah_compile_$mode $R/hc_$mode | tee -a "$OUT/results.jsonl"
done
for mode in off on; do
  timeout 150 $PY -m rlfunc train sac --env Pendulum-v1 --device $DEV --compile $mode --total-steps $SAC_STEPS --learning-starts 1000 \
    --num-steps 500 --eval-episodes 1 --run-dir $R/sac_$mode > "$OUT/sac_$mode.log" 2>&1
  last sac_pendulum_compile_$mode $R/sac_$mode | tee -a "$OUT/results.jsonl"
done
wait $BG ${CPUJOB:-}
cat "$OUT/results.jsonl"; tail -n 3 "$OUT/nccl1.log" "$OUT/nccl2.log"; tail -n 4 "$OUT/prof.log"; tail -n 2 "$OUT/fp16_resume.log" "$OUT/sac-diffusion.log" "$OUT/td3-diffusion.log"; grep -v "^$" "$OUT/compiled_dppo_cpu.txt" | tail -n 4
