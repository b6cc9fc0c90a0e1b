#!/usr/bin/env bash
# GPU check of the dispatch/combine kernels (issue 7); about 2 minutes on one H100/H200-class GPU.
# Run from the repository root on a CUDA machine:  PYTHONPATH=. bash themis_compile/bench/gpu_check.sh
#   1. the kernel test suite (interpreted Triton on CPU tensors, as on any machine);
#   2. `bench kernels`: first a Triton-on-CUDA vs torch-reference check (forward, backward, inductor,
#      int64 offsets past 2**31 elements), then bf16 GB/s at DeepSeek-V3 and Qwen1.5-MoE sizes.
# Output: kernels_gpu_check.json (the benchmark JSON) in the current directory; non-zero exit on failure.
set -euo pipefail
PY="${PYTHON:-python}"
OUT="${OUT:-.}"

"$PY" -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA device'; \
print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"

timeout 100 "$PY" -m pytest -q -p no:cacheprovider tests/kernels

timeout 150 "$PY" -m themis_compile.bench kernels | tee "$OUT/kernels_gpu_check.json"
"$PY" - "$OUT/kernels_gpu_check.json" <<'PYEOF'
import json, sys
result = json.load(open(sys.argv[1]))
check = result["check"]
print("check passed:", check["passed"], check["failures"])
for shape in result["shapes"]:
    for op, entry in shape["ops"].items():
        print(f"{shape['name']:>14} {op:>27}: torch {entry.get('torch_GBps', '-')} GB/s, "
              f"triton {entry.get('triton_GBps', '-')} GB/s, x{entry.get('speedup')}, "
              f"peak fraction {entry.get('triton_fraction_of_peak')}")
sys.exit(0 if check["passed"] else 1)
PYEOF
