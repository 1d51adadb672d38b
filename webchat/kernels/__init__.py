"""Native kernels behind the model's seams: the C++ CPU forward (cpu/) and CUDA kernels through CuPy (cuda/)."""
