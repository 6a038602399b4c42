"""labkit: tools for making deep learning training fast, and proving it.

Modules, one per concept: env (machine and switches), bench (timing), floats (number formats),
matmul (Tensor Cores), amp (mixed precision), data (datasets), loaders (input pipelines), loader_bench
(measuring input pipelines, `labkit data`), bucketing (sequence batching), models (ResNet-18), train (the
engine and the ladder), profiling (diagnosis), report (tables and plots), cli (the `labkit` command).
"""

__version__ = "0.1.0"
