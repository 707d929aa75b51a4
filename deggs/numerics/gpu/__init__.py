"""GPU backend: the CPU backend's arithmetic on CUDA through CuPy, bit for bit.

Same interface as `CpuBackend` (deggs.numerics.backend.Backend). The weights, overlays
and optimizer state live on the device; `params`, `overlays` and `state` are NumPy
copies fetched on access (in the CPU backend's logical layouts), and `load_state` puts
new ones on the device.

One module a concern:
- plan.py: which kernels run a config on a device, compiled with which -D values, with
  how much shared memory: pure functions of (config, device figures), no GPU needed;
- compile.py: the sources (top-level kernels/, installed as deggs.kernels), the
  programs, the compiled sm_90a program's cache; cuda.py: CuPy, the device's figures,
  cuBLAS, the kernel launcher; cores.py: the sm90a kernels' matrix orders;
- state.py: weights, overlays, optimizer state on the device (load, save);
- forward.py, update.py, generate.py: the three paths; backend.py puts them together.

How the work is split (kernels/*.cu; kernels named after model.py's functions):
- every integer matrix product is one cuBLAS int8 x int8 -> int32 GEMM (exact: int32
  accumulation of int8 products), weights stored transposed Wt[out, in] (a layer's q,
  k and v side by side: one GEMM for the three);
- the members' windows of tokens are gathered on the device from a copy of the token
  stream kept there;
- the per-member rank-1 terms, norms, RoPE, attention, GELU table, residuals and the
  integer cross-entropy are fused into a few row kernels, one thread block per member
  (attention: per member and head), which regenerate each member's noise by hashing;
- except the head: in training, head_loss.cu computes the logits on the int8 tensor
  cores and the loss in the same kernel, so no logit is written (the unfused pair,
  cuBLAS then sequence_loss, remains for validation logits, for generation and where
  the kernel's tiles do not fit the device's shared memory); and attention, whose
  scores and mix run on the int8 tensor cores (attention.cu) where head_dim is a
  multiple of 32 (elsewhere attention_mix, on CUDA cores);
- on an H100 or H200, the head, the MLP's up-projection and q, k, v run on Hopper's
  warpgroup MMAs (the sm90a program): head_loss_sm90 and up_gelu_sm90 (the
  up-projection with mlp_up) with the next tile's products during this tile's epilogue,
  qkv_rope_sm90 (the three projections with qkv_rope, a row's products whole in
  registers), so no int32 product of theirs is written, where their tiles fit; the o-
  and down-projections too, with residual_norm as their epilogue (residual_sm90.cu, a
  GEMM pipelined along K; adaptive modes 0 and 1); `hopper=False` keeps the portable
  kernels;
- the update builds, per matrix, the pairs' noise as int8 matrices [index, pair] and
  gets every vote with one int8 GEMM, then runs the optimizer's step (optimizer.cu) and
  the overlay update in elementwise kernels, captured once as a CUDA graph;
- generation runs the row kernels on one unperturbed sequence with a key/value cache and
  samples on the device (generate.py).
"""

from .backend import GpuBackend
from .cuda import gpu_available, why_no_gpu

__all__ = ["GpuBackend", "gpu_available", "why_no_gpu"]
