"""A partition that runs NHWC inside (trainer/strategies/model_parallel.Partition,
`channels_last`) computes what the NCHW one computes, and what crosses to another rank
in either direction stays NCHW-contiguous: gloo sends nothing else."""
from __future__ import annotations

import torch

from mariana.trainer.models.image_cnn import ImageCNN, ImageCNNConfig
from mariana.trainer.strategies.model_parallel import Partition


def test_an_nhwc_partition_computes_the_nchw_one_and_hands_back_nchw_tensors():
    torch.manual_seed(0)
    nchw = ImageCNN(ImageCNNConfig(channels=(8, 16), embed_dim=16))
    nhwc = ImageCNN(ImageCNNConfig(channels=(8, 16), embed_dim=16))
    nhwc.load_state_dict(nchw.state_dict())
    nhwc = nhwc.to(memory_format=torch.channels_last)
    stages = {m: model.fine_stages() for m, model in (("nchw", nchw), ("nhwc", nhwc))}
    x = torch.randn(4, 1, 28, 28)
    for cut in (2, 3):  # the second partition starts after pool1 / after conv2 (its ReLU)
        outs, grads = {}, {}
        for m in ("nchw", "nhwc"):
            first = Partition(stages[m][:cut], channels_last=m == "nhwc")
            rest = Partition(stages[m][cut:], channels_last=m == "nhwc")
            sent = first(x)
            assert sent.is_contiguous()  # what the pipeline sends on
            received = sent.detach().requires_grad_(True)
            logits = rest(received)
            (grad,) = torch.autograd.grad(logits.sum(), received)  # as the pipeline's stage takes it (no .grad)
            assert grad.is_contiguous()  # the gradient the pipeline sends back
            outs[m], grads[m] = logits.detach(), grad
        assert torch.allclose(outs["nchw"], outs["nhwc"], atol=1e-5)
        assert torch.allclose(grads["nchw"], grads["nhwc"], atol=1e-6)
