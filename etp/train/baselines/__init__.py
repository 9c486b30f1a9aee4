"""The peers etp-train measures itself against, with the optimizer-step interface of
:mod:`etp.train.optimizer_steps`: torch FSDP2 (``fsdp2``) and Megatron-FSDP (``megatron_fsdp``).
Comparison baselines for benchmarks, not ways etp trains."""
