#!/usr/bin/env bash
# Third lease: which part of the engine's GPU step moves its greedy tokens off mlx-lm's (the
# CPU in bf16 matched 512 of 512; prompts through cuDNN did not change the GPU's picture, m4).
# One side per difference from mlx-lm's decode: the attention kernel (decode_kernel off: MLX's
# SDPA over gathered pages, as mlx-lm's step), the walk kernel, uncompiled steps, unfused
# projections, and all of them at once with prompts through cuDNN.
RUN=m5; source docs/lab/device-run-1205c/lib.sh
M=$(bash bench/device/real_smollm2.sh) || exit 1
A=native+kernel.decode_kernel=false
SIDES=native,$A,native+kernel.native_decode=walk,native+compiled_decode=false
SIDES=$SIDES,native+fuse_projections=false
SIDES=$SIDES,$A+compiled_decode=false+fuse_projections=false+prefill_attention=fast
step greedy 400 python3 -m bench.greedy_agreement --model "$M" --formats "$SIDES"
