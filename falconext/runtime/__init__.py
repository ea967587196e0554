"""What one rank of any training job runs: tracer, monitor, control client, suspensions,
applying plans and topology switches. Used by the test bed and by the Megatron-LM adapter."""
