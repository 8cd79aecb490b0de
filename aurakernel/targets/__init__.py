"""Targets: where a kernel runs. One package per target (host: C with OpenMP on this CPU; ascend:
AscendC, verified and estimated in the emulator), each with its per-operator kernels under
targets/<target>/ops/<op>.py and its helpers below them. The operator definitions they implement
live in aurakernel/ops/."""
