"""Losses: pure functions of tensors (and params) returning (loss, metrics TensorDict)."""
