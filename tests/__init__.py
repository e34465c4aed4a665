"""lockstep's tests: a folder per part of the server, each a pytest marker (conftest.py; docs/testing.md lists them),
and the helpers they share (conftest.py, client.py, torch_jobs.py, gguf_models.py, worker_faults.py, harness/)."""
