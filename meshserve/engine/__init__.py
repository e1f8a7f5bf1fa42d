"""The token-level engine: the device-free scheduler and block manager, ``EngineCore`` joining them
to the runner, and the offline ``LLM``."""
