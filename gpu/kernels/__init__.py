"""GPU kernels (Triton) and their launch."""
