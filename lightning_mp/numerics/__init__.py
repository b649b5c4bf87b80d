"""Trainer-free numerics: the loss scaler, master weights, the optimizer step, gradient layout, distributed
reduction, sharding, scheduler guard, grad norm. Imports no Lightning."""
