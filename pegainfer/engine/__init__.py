"""Engine: sequences, paged KV bookkeeping, scheduler, model runner (eager or CUDA-graph replay)."""
