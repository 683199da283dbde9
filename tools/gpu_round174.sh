#!/usr/bin/env bash
# Thirty-second session: round 172's work (the step tuner at EP8 x 512, bf16 over the six MoE
# presets and fp8 blockwise at Mixtral-8x7B, into a fresh DB; whole bf16 steps with it against the
# default on near-balanced and exactly balanced routing) on an NVIDIA H200, the candidate for a
# shipped H200 DB (none existed). The run used an identical copy of round 172's commands.
exec bash tools/gpu_round172.sh
