"""lockstep's served decode step counted as ARM64 instructions under qemu-user (count, count-decode, their C
harnesses, decode_steps.py): a measurement of the kernels' code, not of an ARM64 CPU's speed."""
