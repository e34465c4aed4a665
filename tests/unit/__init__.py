"""Unit tests: the engine's parts alone (scheduler with a scripted worker, detokenizer, sampler, messages, pipes),
no model worker. Marker `unit`; with tests/engine/, `make test-fast`."""
