"""Fused CPU kernels in plain C, compiled on first use with the system C compiler and called through ctypes (build.py).

Each kernel has a torch reference it is tested against and a caller that falls back to that reference when the kernel is
unavailable (no compiler, OPENK3_CPU_KERNELS=0, another device or dtype)."""
