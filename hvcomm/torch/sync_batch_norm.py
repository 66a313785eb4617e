"""SyncBatchNorm: batch normalisation whose statistics are those of the whole batch across
the ranks (Horovod's ``hvd.SyncBatchNorm``), forward and backward."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from .autograd import allreduce
from .ops import Sum
from .process_sets import comm_of, global_process_set


def _summed(t: torch.Tensor, process_set) -> torch.Tensor:
    return allreduce(t.detach().double(), op=Sum, process_set=process_set)


class _SyncBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, process_set):
        dims = [d for d in range(x.dim()) if d != 1]
        local = torch.cat([torch.tensor([x.numel() / x.shape[1]], dtype=torch.float64),
                           x.double().sum(dims), (x.double() ** 2).sum(dims)])
        total = _summed(local, process_set)
        c = x.shape[1]
        count, mean = total[0], total[1:1 + c] / total[0]
        var = total[1 + c:] / count - mean ** 2
        if running_mean is not None:
            with torch.no_grad():
                unbiased = var * count / max(count.item() - 1, 1)
                running_mean.mul_(1 - momentum).add_(momentum * mean.to(running_mean.dtype))
                running_var.mul_(1 - momentum).add_(momentum * unbiased.to(running_var.dtype))
        shape = [1, c] + [1] * (x.dim() - 2)
        invstd = (var + eps).rsqrt()
        xhat = ((x.double() - mean.view(shape)) * invstd.view(shape))
        ctx.save_for_backward(xhat, invstd, weight, count)
        ctx.process_set, ctx.dims, ctx.shape = process_set, dims, shape
        out = xhat if weight is None else \
            xhat * weight.double().view(shape) + bias.double().view(shape)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        xhat, invstd, weight, count = ctx.saved_tensors
        dims, shape = ctx.dims, ctx.shape
        dy64 = dy.double()
        local_db, local_dw = dy64.sum(dims), (dy64 * xhat).sum(dims)
        both = _summed(torch.cat([local_db, local_dw]), ctx.process_set)
        sum_dy, sum_dy_xhat = both[:len(local_db)], both[len(local_db):]
        scale = invstd if weight is None else invstd * weight.double()
        dx = scale.view(shape) * (dy64 - sum_dy.view(shape) / count
                                  - xhat * sum_dy_xhat.view(shape) / count)
        dw = None if weight is None else local_dw.to(weight.dtype)  # local, as in torch's: the
        db = None if weight is None else local_db.to(weight.dtype)  # optimizer averages them
        return dx.to(dy.dtype), dw, db, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """``torch.nn.BatchNorm*d`` over the whole batch of every rank (of ``process_set``): in
    training the mean and variance are the global ones, and so are the running statistics;
    in evaluation it is an ordinary batch norm with the running statistics."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, process_set=global_process_set):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input):
        self._check_input_dim(input)
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
        momentum = (self.momentum if self.momentum is not None
                    else 1.0 / float(self.num_batches_tracked))
        if not self.training and self.track_running_stats:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                self.bias, False, 0.0, self.eps)
        comm_of(self.process_set)  # a clear error on a rank outside the set
        return _SyncBatchNormFn.apply(input, self.weight, self.bias,
                                      self.running_mean if self.training else None,
                                      self.running_var if self.training else None,
                                      self.eps, momentum, self.process_set)
