"""The engine with real forked model workers on tiny models: batching, streaming, faults, the worker's start and the
transformers backend's slots, logprobs and penalties. Marker `engine`; with tests/unit/, `make test-fast`."""
