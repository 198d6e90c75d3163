"""Kernel build (nvcc + NVSHMEM device link, cached on disk), load (cuda.core + nvshmem library_init) and launch."""
