#!/usr/bin/env bash
# bf16 training throughput of the PinRanker at a production-sized config on one GPU.
#
#   benchmarks/gpu_training.sh                 # from the repository root, with .venv or python on PATH
#   STEPS=50 BATCH=8192 benchmarks/gpu_training.sh
#
# Production size: 100-step sequences, a 2-layer d=128 transformer, 10M-row pin and user tables and 1M
# creator rows (64-d), a 3-layer cross network and a 512-256 MLP. Batches are random tensors shaped like
# the input pipeline's (ids hashed into the tables as in serving), held on the GPU, so this measures the
# model step alone (forward under bf16 autocast, backward, clip, AdamW), the ceiling for the pipeline.
#
# Self-checks, each failing the script with a message: a CUDA device with bf16 support is present; the
# logits really are bf16 under autocast; every loss is finite; the loss falls over the run (the batches
# repeat, so a working step must fit them). Exit codes: 0 ok, 75 no usable GPU (INFRA), 1 a check failed.
# The last line is one JSON object: examples_per_s, step_ms, peak_memory_gib, parameters, config.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
export STEPS="${STEPS:-30}" WARMUP="${WARMUP:-5}" BATCH="${BATCH:-4096}"

if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else 1)'; then
  echo "gpu_training.sh: no CUDA device with bf16 support visible to $PY (torch.cuda.is_available() is False)" >&2
  exit 75
fi

exec "$PY" - <<'EOF'
import json, math, os, sys, time
import torch
from features.contracts import ACTIONS, DENSE_FEATURES, EMBEDDING_DIM, LABELS, SURFACES
from training.models.pin_ranker import ModelConfig, PinRanker, multitask_loss

steps, warmup, batch = int(os.environ["STEPS"]), int(os.environ["WARMUP"]), int(os.environ["BATCH"])
config = ModelConfig(sequence_length=100, d_model=128, n_heads=4, n_layers=2, ff_dim=512, first_k=8,
                     sparse_dim=64, pin_buckets=10_000_019, user_buckets=10_000_019, creator_buckets=1_000_003,
                     category_buckets=10_007, cross_layers=3, mlp_hidden=(512, 256))
device = torch.device("cuda", 0)
torch.manual_seed(0)
torch.backends.cuda.matmul.allow_tf32 = True
model = PinRanker(config).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
params = sum(p.numel() for p in model.parameters())

def random_batch(seed):
    g = torch.Generator(device=device).manual_seed(seed)
    n, b = config.sequence_length, batch
    lengths = torch.randint(0, n + 1, (b,), device=device, generator=g)
    mask = torch.arange(n, device=device)[None, :] < lengths[:, None]
    ids = lambda high: torch.randint(1, high, (b,), device=device, generator=g)
    return {
        "seq_pin_emb": torch.randn(b, n, EMBEDDING_DIM, device=device, generator=g) * mask[..., None],
        "seq_actions": torch.where(mask, torch.randint(1, len(ACTIONS) + 1, (b, n), device=device, generator=g), 0),
        "seq_categories": torch.where(mask, torch.randint(0, 1000, (b, n), device=device, generator=g), -1),
        "seq_age_hours": torch.rand(b, n, device=device, generator=g) * 720 * mask,
        "seq_mask": mask,
        "cand_pin_emb": torch.randn(b, EMBEDDING_DIM, device=device, generator=g),
        "pin_id": ids(10**12), "user_id": ids(10**12), "category": ids(1000), "creator_id": ids(10**9),
        "surface": torch.randint(1, len(SURFACES) + 1, (b,), device=device, generator=g),
        "dense": torch.rand(b, len(DENSE_FEATURES), device=device, generator=g) * 10,
        "labels": (torch.rand(b, len(LABELS), device=device, generator=g) < 0.1).float(),
    }

batches = [random_batch(i) for i in range(4)]

def step(b):
    inputs = {k: v for k, v in b.items() if k != "labels"}
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(inputs)
    loss, _ = multitask_loss(logits, b["labels"], {})
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss, logits

def fail(message):
    print(f"gpu_training.sh: check failed: {message}", file=sys.stderr)
    sys.exit(1)

losses = []
for i in range(warmup):
    loss, logits = step(batches[i % len(batches)])
    losses.append(loss.item())
if logits[LABELS[0]].dtype != torch.bfloat16:
    fail(f"logits are {logits[LABELS[0]].dtype} under autocast, expected torch.bfloat16")
torch.cuda.synchronize()
torch.cuda.reset_peak_memory_stats()
start = time.perf_counter()
timed = []
for i in range(steps):
    loss, _ = step(batches[i % len(batches)])
    timed.append(loss)
torch.cuda.synchronize()
seconds = time.perf_counter() - start
losses += [x.item() for x in timed]
if not all(math.isfinite(x) for x in losses):
    fail(f"non-finite loss: {losses}")
head, tail = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
if not tail < head:
    fail(f"the loss did not fall over {len(losses)} steps on repeated batches: {head:.4f} -> {tail:.4f}")
print(json.dumps({
    "examples_per_s": round(batch * steps / seconds, 1),
    "step_ms": round(1000 * seconds / steps, 2),
    "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
    "parameters": params,
    "loss_first": round(head, 4), "loss_last": round(tail, 4),
    "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
    "config": {**config.to_dict(), "batch_size": batch, "steps": steps, "dtype": "bf16 autocast"},
}), flush=True)
EOF
