#!/usr/bin/env bash
# Twenty-fifth session, fourth call, on an NVIDIA H100: round 134's command again (the attention
# GPU tests and probe_attention.py) on the fix it called for, the compiled path's backward
# recomputing varlen calls on the padded path.
exec bash tools/gpu_round134.sh
