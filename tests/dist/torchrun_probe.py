"""Run under `torchrun --nproc-per-node 2 tests/dist/torchrun_probe.py OUT_DIR` on a machine without a GPU: flux_shmem's torch.distributed bootstrap
(launcher detection, host collectives over gloo, unique-id broadcast, argument agreement, the NoGPUError of
init), then flux_shmem.nn's layers on torch.distributed (gloo, CPU tensors): a small Llama block eager and
compiled with torch.compile(fullgraph=True), every output and gradient against an unsharded reference."""
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import flux_shmem  # noqa: E402
from benchmarks.llama_block import BlockConfig, TPBlock, compare_step, reference_step, seq_shard, shard_full  # noqa
from flux_shmem.runtime import bootstrap, symmetric  # noqa: E402

report = {}
host = bootstrap.host_collectives()  # torchrun's environment, no MPI: torch.distributed, initialised here
report["launcher"] = host.name
report["backend"] = dist.get_backend()
rank = host.rank
layout, hosts = bootstrap.discover_layout(host)
report["layout"] = [layout.rank, layout.world_size, layout.local_rank, layout.local_size, layout.node,
                    layout.num_nodes]
uid = bootstrap.broadcast_unique_id(host)
report["uid_equal"] = len(set(host.allgather(bytes(uid._data)))) == 1
report["bytes"] = host.broadcast_bytes(b"from 1" if rank == 1 else None, root=1).decode()
try:
    symmetric.agree("test shape", (4, 4 + rank), host=host, timeout_s=20)
except flux_shmem.SymmetricMismatchError as e:
    report["mismatch"] = str(e)
symmetric.agree("same", (4, 4), host=host, timeout_s=20)
if rank == 1:  # PE 0 waits alone and must give up instead of hanging; then PE 1 completes its orphan barrier
    time.sleep(3)
    host.barrier()
else:
    try:
        symmetric.agree("lonely", 1, host=host, timeout_s=1)
    except flux_shmem.FluxShmemError as e:
        report["timeout"] = str(e)
host.barrier()
try:
    flux_shmem.init()
except flux_shmem.NoGPUError as e:
    report["init"] = str(e)

# flux_shmem.nn over torch.distributed (flux_shmem is not initialised: the default backend is TorchBackend)
cfg = BlockConfig(hidden=32, heads=8, kv_heads=4, head_dim=4, ffn=48, bias=True)
W = dist.get_world_size()
torch.set_default_dtype(torch.float64)
g = torch.Generator().manual_seed(7)
x, gy = torch.randn(8, 2, cfg.hidden, generator=g), torch.randn(8, 2, cfg.hidden, generator=g)
ref = reference_step(cfg, x, gy, seed=11, dtype=torch.float64)
block = TPBlock(cfg)
report["block_backend"] = block.qkv.backend.name
block.load_state_dict(shard_full(cfg, ref[3], rank, W))
report["eager"] = compare_step(block, seq_shard(x, rank, W), seq_shard(gy, rank, W), ref)
compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
report["compiled"] = compare_step(block, seq_shard(x, rank, W), seq_shard(gy, rank, W), ref, forward=compiled)
Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps(report))  # a file each: stdout lines interleave
dist.destroy_process_group()
