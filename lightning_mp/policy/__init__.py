"""The FP32 policy: the op table and its names, the dispatcher kernels, the module hooks, ``describe()``."""
