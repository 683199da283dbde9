"""Stand-in for ``aiter.dtypes``: ``fp8`` is the GPU's e4m3 dtype (float8_e4m3fnuz on gfx942,
float8_e4m3fn on gfx950); the tests set it to match the architecture they pretend to run on."""
import torch

fp8 = torch.float8_e4m3fn
bf16 = torch.bfloat16
fp16 = torch.float16
fp32 = torch.float32
