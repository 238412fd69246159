"""localllm: run quantized language models locally."""

__version__ = "0.1.0"

from .machine import keep_openmp_barriers_spinning

# Before any module loads llama.cpp, whose OpenMP runtime reads its settings once.
keep_openmp_barriers_spinning()
