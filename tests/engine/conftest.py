"""Engine tests: the environment must be set before vLLM is first imported (engine_support)."""

import engine_support  # noqa: F401  (sets VLLM_CPU_KVCACHE_SPACE, VLLM_TARGET_DEVICE, offline flags)
