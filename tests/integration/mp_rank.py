"""One rank of a small model parallel x data parallel run, for
tests/integration/test_model_parallel.py:
`python -m tests.integration.mp_rank OUT GROUPS PARTITIONS MICROBATCHES SCHEDULE STEPS RECOMPUTE`
with RANK, WORLD_SIZE and MARIANA_DIST_INIT set (or none: one process). A small ImageCNN on
seeded random images; writes OUT/rank{R}.safetensors: the gradients of the first step
("grad." + the model's parameter name) and the parameters after STEPS steps ("param." + name)
of this rank's partition, and the first step's loss on the last stage."""
from __future__ import annotations

import gc
import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from mariana.trainer.models.image_cnn import ImageCNN, ImageCNNConfig
from mariana.trainer.strategies import data_parallel as dp
from mariana.trainer.strategies.model_parallel import Layout, Partition, PipelineStep, balance


def main() -> None:
    out, groups, parts, micro, schedule, steps, recompute = sys.argv[1:8]
    layout = Layout(int(groups), int(parts))
    torch.set_num_threads(1)
    ctx = dp.DistContext.from_env()
    dp.init_distributed(ctx, "gloo", os.environ.get("MARIANA_DIST_INIT"), timeout_s=60)
    torch.manual_seed(0)
    model = ImageCNN(ImageCNNConfig(size=16, channels=(4, 8), embed_dim=16))
    stages = model.stages()
    cuts = balance([sum(p.numel() for p in m.parameters()) + 1.0 for _, m in stages], layout.partitions)
    g, p = layout.coords(ctx.rank)
    start, stop = cuts[p]
    part = Partition(stages[start:stop], recompute=recompute == "1")
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(64, 1, 16, 16, generator=gen), torch.randint(0, 10, (64,), generator=gen)
    step = PipelineStep(part, layout, ctx.rank, int(micro), schedule, F.cross_entropy, torch.device("cpu"))
    opt = torch.optim.SGD(part.parameters(), lr=0.1)
    saved = {}
    for k in range(int(steps)):
        rows = (torch.arange(32) + 32 * k) % 64
        mine = rows.tensor_split(layout.groups)[g]
        opt.zero_grad(set_to_none=True)
        loss = step.step(x[mine], y[mine])
        if k == 0:
            saved.update({f"grad.{n}": q.grad.detach().clone() for n, q in part.named_parameters()})
            if loss is not None:
                saved["loss"] = loss.detach().reshape(1).float()
        opt.step()
    saved.update({f"param.{n}": q.detach().clone() for n, q in part.named_parameters()})
    del step
    gc.collect()  # the pipeline objects go before the group, as trainer/image.py does
    if ctx.distributed:
        torch.distributed.barrier()
    dp.shutdown_distributed()
    save_file({k: v.contiguous() for k, v in saved.items()}, f"{out}/rank{ctx.rank}.safetensors")


if __name__ == "__main__":
    main()
