"""SYMM_MEM backend: MoE dispatch/combine through torch's symmetric memory and our Triton kernels."""
