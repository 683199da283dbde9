"""Token-count buckets: which problem keys share one backend decision.

Under dropless MoE routing the tokens a rank receives (a grouped GEMM's M_total, or the K of its
weight gradient) change every step. Keyed exactly, each new count would be a new key: autotuning
would profile again on every step, a tuning DB made offline would never match a training step,
and the decision cache would grow without bound. So these counts are rounded up to a bucket, and
every count in one bucket shares the decision made (and tuned) at the bucket's top.

Buckets: 0 alone (an empty problem), powers of two up to ``SMALL`` (where a tile choice moves
with every doubling), then four per octave above it (a count and its bucket's top differ by at
most a quarter: 257 -> 320, 32769 -> 40960). That keeps about 4 keys per doubling of the tokens.
"""
from __future__ import annotations

#: Counts up to this are bucketed by powers of two.
SMALL = 256
#: Buckets per octave above ``SMALL``.
PER_OCTAVE = 4


def token_bucket(tokens: int) -> int:
    """The top of ``tokens``' bucket: the count whose key (and decision) ``tokens`` shares.

    >>> [token_bucket(t) for t in (0, 1, 3, 200, 256, 257, 320, 321, 32768, 32769, 131073)]
    [0, 1, 4, 256, 256, 320, 320, 384, 32768, 40960, 163840]
    """
    if tokens <= 0:
        return tokens
    if tokens <= SMALL:
        return 1 << (tokens - 1).bit_length()
    octave = 1 << ((tokens - 1).bit_length() - 1)  # octave < tokens <= 2 * octave
    step = octave // PER_OCTAVE
    return -(-tokens // step) * step


__all__ = ["PER_OCTAVE", "SMALL", "token_bucket"]
