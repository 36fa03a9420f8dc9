"""The looped families on megatron-core: the model and its providers (`model.py`: LoopedGPT,
build_policy, build_critic), its tensor-parallel building blocks in both numerics modes
(`layers.py`), the run-level build options and megatron's TransformerConfig (`options.py`), and
megatron-core made to run on CPU over gloo (`cpu.py`: apply_cpu_compat; `rng.py`: megatron's
RNG tracker on the CPU generator; `errors.py`: CpuCompatError, which both raise).
docs/LEARNER_MODELS.md, docs/LEARNER_CPU.md."""
