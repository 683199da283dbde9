"""pytest plugin (round 99 only): the Triton dual kernel stores its transposed copy from a
tl.trans'd tile."""
import turbo_dispatch.backends.triton.dual_quantize as DQ

DQ.TRANSPOSE_FIRST = True
