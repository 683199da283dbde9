"""Stand-in for ``aiter.tuned_gemm``: ``tgemm.mm(inp, weights, ...)`` = ``inp @ weights^T`` (F.linear)."""
import torch

from . import CALLS


class TunedGemm:
    def mm(self, inp, weights, bias=None, otype=None, scale_a=None, scale_b=None, scale_c=None):
        """inp [M, K] @ weights [N, K]^T; the stand-in asks for contiguous operands, which every
        kernel behind the library's dispatcher takes."""
        assert inp.dim() == 2 and weights.dim() == 2 and inp.shape[1] == weights.shape[1], \
            f"inp [M, K] and weights [N, K]; got {tuple(inp.shape)}, {tuple(weights.shape)}"
        assert inp.is_contiguous() and weights.is_contiguous(), "inp and weights must be contiguous"
        assert inp.dtype == weights.dtype and inp.dtype in (torch.bfloat16, torch.float16)
        CALLS.append(("tgemm.mm", {"otype": otype}))
        out = inp.double() @ weights.double().t()
        if bias is not None:
            out = out + bias.double()
        return out.to(otype or inp.dtype)


tgemm = TunedGemm()
