"""megatron phase."""
