"""labkit: tools for making deep learning training fast, and proving it.

Modules, one per concept, from the bottom up: errors (LabkitError), outputs (output paths and result files),
progress (bars and progress lines), env (machine and switches), bench (timing), floats (number formats), matmul
(Tensor Cores), amp (mixed precision), data (datasets), loaders (input pipelines), loader_bench (measuring input
pipelines, `labkit data`), bucketing (sequence batching), models (ResNet-18), presets (TrainConfig and the
ladder), report (tables and plots), train (the engine and the ladder runner), profiling (diagnosis), cli (the
`labkit` command). Beside floats and matmul: accumulation (rounding in sums and weight updates), fp8 (scaling
into fp8), waves (tiles, waves and datasheet peaks) and predict (a prediction beside its measurement). Beside amp
and loaders: autocast_ops (the dtype each op produces under autocast) and overlap (copy-compute overlap).
Each week's exercise checks are weekN_exercises (exercises runs them). The top rung's fast cold start is the
faststart package (the compile-cache artifact, the tiered start, the cuDNN warm-up), reached only from train.
"""

__version__ = "0.1.0"
