"""Processes: `rljob run`, the pod's entry point, the process guard, torch.distributed and GPU pools."""
