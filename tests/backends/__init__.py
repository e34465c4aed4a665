"""The worker's backends on real models: lockstep's own kernels (4-bit, bfloat16), the lean decode step, GGUF files of
every family, the prefix cache, vLLM's workers and CUDA. Marker `backends`."""
