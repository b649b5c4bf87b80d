"""The TensorBoard callbacks and their shared base."""
