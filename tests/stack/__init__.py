"""The stack: torch above the backend, and how jobs are started.

DDP, FSDP2, tensor parallel, DTensor, functional collectives (also compiled), pipelining,
ZeRO, checkpoint and profiler over ``neuron``; the main training job and TorchTitan under
torchrun; PyTorch's own distributed suite (upstream_dist.py, run in a subprocess);
c10d behaviour torch's tests rely on; init methods and torchrun restarts (restart_job.py);
the README's commands, run as written (test_readme.py).
"""
