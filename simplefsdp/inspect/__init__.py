"""See what the compiler did to a wrapped model's training step: graphs, buckets, schedule, memory, pictures."""
