"""megatron-core integration of etp. megatron-core is imported lazily, only from here."""
