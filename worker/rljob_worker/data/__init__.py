"""What a run trains on and from: prompt and SFT data, batching, token budgets, synthetic tasks, models."""
